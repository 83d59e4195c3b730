// The baselines the planner is measured against (Megatron first fit, length bucketing,
// OmniBal's ISF, HBP's GreedyFill), each producing micro-batches per replica.
// Mirrors dcp_ext/assign/ref_baselines.py (documented there) operation for operation.
#include <stdexcept>

#include "assign_kernels.hpp"

namespace dcp {
namespace {

constexpr double kIsfFill = 0.95;
constexpr int kIsfRounds = 10;

int64_t seq_length(const std::vector<Params>& params) {
  int64_t L = params[0].cap();
  for (const auto& p : params) L = std::min(L, p.cap());
  return L;
}

std::vector<MicroBatches> round_robin(const int64_t* len, const std::vector<Params>& params, const MicroBatches& bins) {
  const size_t R = params.size();
  std::vector<MicroBatches> out(R);
  size_t ptr = 0;
  for (const auto& b : bins) {
    int64_t tokens = 0, longest = 0;
    for (int64_t i : b) tokens += len[i], longest = std::max(longest, len[i]);
    for (size_t k = 0; k < R; ++k) {
      const size_t r = (ptr + k) % R;
      if (longest <= params[r].cap() && tokens <= params[r].max_mb_tokens) {
        std::vector<int64_t> mb(b);
        std::sort(mb.begin(), mb.end());
        out[r].push_back(std::move(mb));
        ptr = r + 1;
        break;
      }
    }
  }
  return out;
}

MicroBatches next_fit(const int64_t* len, const std::vector<int64_t>& items, int64_t L) {
  MicroBatches bins;
  std::vector<int64_t> cur;
  int64_t tok = 0;
  for (int64_t i : items) {
    const int64_t s = len[i];
    if (s > L) {
      if (!cur.empty()) bins.push_back(cur);
      bins.push_back({i});
      cur.clear();
      tok = 0;
      continue;
    }
    if (!cur.empty() && tok + s > L) {
      bins.push_back(cur);
      cur.clear();
      tok = 0;
    }
    cur.push_back(i);
    tok += s;
  }
  if (!cur.empty()) bins.push_back(cur);
  return bins;
}

std::vector<MicroBatches> megatron(const int64_t* len, int64_t n, const std::vector<Params>& params) {
  const int64_t L = seq_length(params);
  MicroBatches bins;
  std::vector<int64_t> room;  // -1: a closed bin holding one over-long sequence
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = len[i];
    if (s > L) {
      bins.push_back({i});
      room.push_back(-1);
      continue;
    }
    bool placed = false;
    for (size_t k = 0; k < bins.size(); ++k) {
      if (room[k] >= s) {
        bins[k].push_back(i);
        room[k] -= s;
        placed = true;
        break;
      }
    }
    if (!placed) {
      bins.push_back({i});
      room.push_back(L - s);
    }
  }
  return round_robin(len, params, bins);
}

std::vector<MicroBatches> bucketing(const int64_t* len, int64_t n, const std::vector<Params>& params) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [len](int64_t x, int64_t y) { return len[x] < len[y]; });
  return round_robin(len, params, next_fit(len, order, seq_length(params)));
}

std::vector<MicroBatches> isf(const int64_t* len, int64_t n, const std::vector<Params>& params, uint64_t seed) {
  const int64_t L = seq_length(params);
  SplitMix64 rng(seed);
  const double thresh = kIsfFill * static_cast<double>(L);
  std::vector<int64_t> pool;
  for (int64_t i = 0; i < n; ++i)
    if (len[i] <= L) pool.push_back(i);
  MicroBatches out;
  for (int rnd = 0; rnd < kIsfRounds; ++rnd) {
    if (pool.empty()) break;
    rng.shuffle(pool);
    MicroBatches groups = next_fit(len, pool, L);
    if (rnd == kIsfRounds - 1) {
      for (auto& g : groups) out.push_back(std::move(g));
      break;
    }
    std::vector<int64_t> rest;
    for (auto& g : groups) {
      int64_t tok = 0;
      for (int64_t i : g) tok += len[i];
      if (static_cast<double>(tok) >= thresh)
        out.push_back(std::move(g));
      else
        rest.insert(rest.end(), g.begin(), g.end());
    }
    pool = std::move(rest);
  }
  for (int64_t i = 0; i < n; ++i)
    if (len[i] > L) out.push_back({i});
  return round_robin(len, params, out);
}

MicroBatches greedy_fill(const int64_t* len, std::vector<int64_t> items, int64_t pack_len) {
  std::stable_sort(items.begin(), items.end(), [len](int64_t x, int64_t y) { return len[x] > len[y]; });
  const int64_t n = static_cast<int64_t>(items.size());
  std::vector<int64_t> nxt(n + 1);
  std::iota(nxt.begin(), nxt.end(), 0);
  auto find = [&nxt](int64_t p) {
    while (nxt[p] != p) {
      nxt[p] = nxt[nxt[p]];
      p = nxt[p];
    }
    return p;
  };
  auto first_fitting = [&](int64_t room) {  // first position with length <= room
    return std::partition_point(items.begin(), items.end(), [&](int64_t i) { return len[i] > room; }) - items.begin();
  };
  MicroBatches packs;
  for (int64_t p0 = find(0); p0 < n; p0 = find(0)) {
    nxt[p0] = p0 + 1;
    std::vector<int64_t> pk{items[p0]};
    int64_t room = pack_len - len[items[p0]];
    for (;;) {
      const int64_t p = find(first_fitting(room));
      if (p >= n) break;
      nxt[p] = p + 1;
      pk.push_back(items[p]);
      room -= len[items[p]];
    }
    packs.push_back(std::move(pk));
  }
  return packs;
}

double mb_cost(const Params& p, const int64_t* len, const std::vector<int64_t>& mb) {
  double acc = p.o;
  for (int64_t i : mb) acc += seq_cost(p, len[i]);
  return acc;
}

std::vector<MicroBatches> hbp(const int64_t* len, int64_t n, const std::vector<Params>& params) {
  const size_t R = params.size();
  std::vector<int64_t> levels;
  for (const auto& p : params) levels.push_back(p.cap());
  std::sort(levels.begin(), levels.end());
  levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
  std::vector<std::vector<int64_t>> level_items(levels.size());
  for (int64_t i = 0; i < n; ++i)
    level_items[std::lower_bound(levels.begin(), levels.end(), len[i]) - levels.begin()].push_back(i);
  std::vector<MicroBatches> out(R);
  for (size_t li = 0; li < levels.size(); ++li) {
    std::vector<size_t> reps;
    for (size_t r = 0; r < R; ++r)
      if (params[r].cap() == levels[li]) reps.push_back(r);
    int64_t pack_len = params[reps[0]].max_mb_tokens;
    for (size_t r : reps) pack_len = std::min(pack_len, params[r].max_mb_tokens);
    MicroBatches packs = greedy_fill(len, level_items[li], pack_len);
    const Params& p0 = params[reps[0]];
    std::vector<double> costs(packs.size());
    for (size_t k = 0; k < packs.size(); ++k) costs[k] = mb_cost(p0, len, packs[k]);
    std::vector<size_t> order(packs.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&costs](size_t x, size_t y) { return costs[x] > costs[y]; });
    std::vector<double> load(R, 0.0);
    for (size_t k : order) {
      int64_t best_r = -1;
      double best = 0.0;
      for (size_t r : reps) {
        const double val = load[r] + mb_cost(params[r], len, packs[k]);
        if (best_r < 0 || val < best) best_r = static_cast<int64_t>(r), best = val;
      }
      load[best_r] = best;
      std::vector<int64_t> mb(packs[k]);
      std::sort(mb.begin(), mb.end());
      out[best_r].push_back(std::move(mb));
    }
  }
  return out;
}

}  // namespace

std::vector<MicroBatches> baseline(const std::string& name, const int64_t* len, int64_t n,
                                   const std::vector<Params>& params, uint64_t seed) {
  if (name == "megatron") return megatron(len, n, params);
  if (name == "bucketing") return bucketing(len, n, params);
  if (name == "isf") return isf(len, n, params, seed);
  if (name == "hbp") return hbp(len, n, params);
  throw std::invalid_argument("unknown baseline " + name);
}

}  // namespace dcp
