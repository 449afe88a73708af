// SHARDS-sampled online LRU stack distances: index/reuse.py's StackDistance in native
// code, with the same histogram bit for bit (tests/test_native_reuse.py runs random block
// streams through both: threshold drops, horizon, hot set, duplicates, prefetch touches).
//
// Why native: in Python each tracked block cost ~8 us (a SortedDict bisect, delete and
// insert, a dict and a heap), so a 33K-token turn (2K blocks, every one tracked while the
// sample fills) cost ~17 ms per stack and ~34 ms per request for the pooled and the
// worker's stack; here it is a Fenwick tree step and a hash probe per block.
//
// Layout. Each tracked block has a time slot (1..T, in order of last use); ``last_`` maps
// its hash to that slot, ``hash_`` the slot back to the hash, and a Fenwick tree over the
// slots counts the live ones, so a block's depth (tracked blocks used since it) is
// ``live - prefix(slot)``: what Python's SortedDict bisect gives. Slots are handed out
// from a clock; when they run out the live ones are renumbered in order (O(T), once per
// ~T/2 uses). The threshold drop (SHARDS-adj) pops the largest tracked hash from a max
// heap with lazy deletion, as Python does; the horizon pops the oldest live slot.
//
// Not thread-safe by itself: the binding holds one mutex per object around each call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <queue>
#include <vector>

#include "flat_map.hpp"

namespace cr {

// index/reuse.py's histogram: exact up to 64 blocks, then 32 buckets per doubling.
constexpr int RD_SUB = 32;
constexpr int RD_EXACT = 2 * RD_SUB;
constexpr int RD_MAX_BITS = 47;
constexpr int RD_NUM_BUCKETS = RD_EXACT + (RD_MAX_BITS - 6) * RD_SUB;
constexpr int64_t RD_MAX_CAPACITY = (int64_t{1} << RD_MAX_BITS) - 1;
constexpr double RD_FULL = 18446744073709551616.0;  // 2**64

inline int reuse_bucket(int64_t need) {
    if (need < RD_EXACT) return static_cast<int>(need);
    if (need > RD_MAX_CAPACITY) need = RD_MAX_CAPACITY;
    const int b = 63 - __builtin_clzll(static_cast<uint64_t>(need));
    return RD_EXACT + (b - 6) * RD_SUB + static_cast<int>(need >> (b - 5)) - RD_SUB;
}

// Python's floor division (num_tokens may be 0: no block can hit).
inline int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
    return q;
}

class StackDistance {
   public:
    // ``full``: every hash is sampled (Python's threshold == 2**64); else those below
    // ``threshold``. ``horizon`` < 0: none.
    StackDistance(int64_t max_tracked, bool full, uint64_t threshold, int64_t horizon,
                  int64_t hot_blocks)
        : max_tracked(max_tracked),
          horizon(horizon),
          hot_blocks(hot_blocks),
          full(full),
          threshold(threshold),
          buckets(RD_NUM_BUCKETS, 0.0),
          hot_bucket_(reuse_bucket(std::max<int64_t>(1, hot_blocks - 1))) {}

    const int64_t max_tracked, horizon, hot_blocks;
    bool full;
    uint64_t threshold;
    std::vector<double> buckets;
    int64_t tokens = 0, requests = 0, accesses = 0, sampled = 0;

    size_t tracked() const { return last_.size(); }

    size_t bytes() const {
        return last_.bytes() + hot_.bytes() + hot_prev_.bytes() +
               hash_.capacity() * sizeof(uint64_t) + on_.capacity() + fen_.capacity() * sizeof(int32_t) +
               heap_.size() * sizeof(uint64_t) + picked_.capacity() * sizeof(Pick) +
               buckets.capacity() * sizeof(double);
    }

    // One request (``count``) or a prefetch's blocks (not counted, no hit recorded).
    void observe(const uint64_t* hashes, size_t n, int64_t num_tokens, int64_t block_size,
                 bool count) {
        if (count) {
            tokens += num_tokens;
            requests += 1;
            accesses += static_cast<int64_t>(n);
        }
        const int64_t eligible = count ? floor_div(num_tokens - 1, block_size) : 0;
        int64_t lead = 0;  // leading blocks in the hot set
        if (hot_blocks) {
            lead = touch_hot(hashes, n, std::min<int64_t>(static_cast<int64_t>(n), eligible));
            if (full)
                lead = 0;  // every block is tracked: their depths are exact
            else if (lead)
                buckets[hot_bucket_] += static_cast<double>(lead * block_size);
        }
        picked_.clear();
        for (size_t i = 0; i < n; ++i)
            if (full || hashes[i] < threshold) picked_.push_back({static_cast<int64_t>(i), hashes[i]});
        if (picked_.empty()) return;
        sampled += static_cast<int64_t>(picked_.size());
        const double rate = full ? 1.0 : static_cast<double>(threshold) / RD_FULL;
        const double weight = static_cast<double>(block_size) / rate;
        const int64_t floor = hot_blocks && !full ? hot_blocks / 2 + 1 : 1;
        const int64_t live = live_;
        for (const Pick& p : picked_) {  // depths against the stack before the request
            if (p.at < lead || p.at >= eligible) continue;
            const uint32_t* t = last_.find(p.hash);
            if (!t) continue;
            const double q = static_cast<double>(live - prefix(*t)) / rate;
            int64_t need = q >= static_cast<double>(RD_MAX_CAPACITY)
                               ? RD_MAX_CAPACITY
                               : static_cast<int64_t>(q) + 1;
            buckets[reuse_bucket(std::max(floor, need))] += weight;
        }
        if (clock_ + picked_.size() >= slots()) compact(picked_.size());
        for (size_t k = picked_.size(); k-- > 0;) {  // tail first: the first block ends most recent
            const uint64_t m = picked_[k].hash;
            bool inserted;
            uint32_t& t = last_.get_or_insert(m, inserted);
            if (inserted)
                heap_.push(m);
            else
                kill(t);
            t = static_cast<uint32_t>(++clock_);
            hash_[t] = m;
            on_[t] = 1;
            add(t, 1);
            ++live_;
        }
        bound();
    }

   private:
    struct Pick {
        int64_t at;
        uint64_t hash;
    };

    FlatMap<uint32_t> last_;          // tracked hash -> its slot
    std::vector<uint64_t> hash_{0};   // slot -> hash (slot 0 unused)
    std::vector<uint8_t> on_{0};      // slot -> 1 while live
    std::vector<int32_t> fen_{0};     // Fenwick tree over slots 1..T: 1 where live
    std::priority_queue<uint64_t> heap_;  // tracked hashes (and some gone): the largest
    FlatMap<uint8_t> hot_, hot_prev_;     // the hot set's current and previous generation
    std::vector<Pick> picked_;
    size_t clock_ = 0;  // the last slot handed out
    size_t head_ = 1;   // no live slot below it
    int64_t live_ = 0;
    const int hot_bucket_;

    size_t slots() const { return fen_.size() - 1; }

    int64_t prefix(size_t t) const {  // live slots in 1..t
        int64_t s = 0;
        for (; t; t &= t - 1) s += fen_[t];
        return s;
    }

    void add(size_t t, int32_t d) {
        for (const size_t n = fen_.size(); t < n; t += t & (~t + 1)) fen_[t] += d;
    }

    void kill(uint32_t t) {
        add(t, -1);
        --live_;
        on_[t] = 0;
    }

    // Renumber the live slots 1..live in order, with room for ``extra`` more.
    void compact(size_t extra) {
        size_t cap = 1024;
        while (cap < 2 * (static_cast<size_t>(live_) + extra)) cap *= 2;
        std::vector<uint64_t> hashes(cap + 1, 0);
        size_t j = 0;
        for (size_t t = head_; t <= clock_; ++t) {
            if (!on_[t]) continue;
            hashes[++j] = hash_[t];
            *last_.find(hash_[t]) = static_cast<uint32_t>(j);
        }
        hash_.swap(hashes);
        on_.assign(cap + 1, 0);
        fen_.assign(cap + 1, 0);
        for (size_t t = 1; t <= j; ++t) on_[t] = 1, fen_[t] = 1;
        for (size_t t = 1; t <= cap; ++t) {  // linear build
            const size_t up = t + (t & (~t + 1));
            if (up <= cap) fen_[up] += fen_[t];
        }
        clock_ = j;
        head_ = 1;
    }

    void pop_oldest() {
        while (!on_[head_]) ++head_;
        const uint64_t m = hash_[head_];
        kill(static_cast<uint32_t>(head_));
        last_.erase(m);  // its heap entry goes when it comes up
    }

    void bound() {
        while (static_cast<int64_t>(last_.size()) > max_tracked) {
            const uint64_t m = heap_.top();
            heap_.pop();
            const uint32_t* t = last_.find(m);
            if (t) {  // the largest: from now on only hashes below it are sampled
                full = false;
                threshold = m;
                kill(*t);
                last_.erase(m);
            }
        }
        if (horizon >= 0) {
            // the oldest tracked block sits at depth live - 1 (tracked), (live - 1) / R blocks;
            // horizon * R rounded once, as Python's int / int does
            const double limit =
                full ? static_cast<double>(horizon)
                     : static_cast<double>(static_cast<unsigned __int128>(horizon) * threshold) /
                           RD_FULL;
            while (live_ > 0 && static_cast<double>(live_ - 1) > limit) pop_oldest();
            if (heap_.size() > 2 * last_.size() + 64) {
                std::vector<uint64_t> keep;
                keep.reserve(last_.size());
                last_.for_each([&](uint64_t h, uint32_t) { keep.push_back(h); });
                heap_ = std::priority_queue<uint64_t>(std::less<uint64_t>(), std::move(keep));
            }
        }
    }

    // The leading hot blocks of the first ``cap``; then every block enters, tail first.
    // A generation holds hot_blocks / 2 distinct blocks (index/reuse.py's _touch_hot,
    // whose chunked inserts rotate exactly where these per-block ones do).
    int64_t touch_hot(const uint64_t* hashes, size_t n, int64_t cap) {
        int64_t lead = 0;
        while (lead < cap && (hot_.find(hashes[lead]) || hot_prev_.find(hashes[lead]))) ++lead;
        const size_t half = static_cast<size_t>(hot_blocks / 2);
        for (size_t k = n; k-- > 0;) {
            bool inserted;
            hot_.get_or_insert(hashes[k], inserted);
            if (hot_.size() >= half) {
                std::swap(hot_, hot_prev_);
                hot_.clear_keep();
            }
        }
        return lead;
    }
};

}  // namespace cr
