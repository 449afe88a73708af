// The candidates that can win a routing decision in a wide pool: the least loaded few of
// every class of holders (same leading blocks held in every tier) and of the targets that
// hold nothing, out of a board of per-target load keys kept current as loads move.
//
// A policy's cost for a candidate grows with its load and falls with its hit; between
// two candidates with the same hit, the less loaded one costs no more. So the winner is
// among the least loaded of its hit class, and a class's more loaded members need no
// view built and no cost computed (router/routing/prune.py says when this holds and what
// happens when it does not). Work per decision: the index walk, then O(targets) integer
// compares here; Python sees only the few kept (16 to 40 at 1,024 targets).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace cr {

// One target's hit, per tier (as Core.match_tiers gives it), with its board slot.
struct Held {
    int slot;
    int gpu, cpu, disk, total;
    bool same_class(const Held& o) const {
        return gpu == o.gpu && cpu == o.cpu && disk == o.disk && total == o.total;
    }
};

class LoadBoard {
   public:
    // The load key least_load orders by: in-flight requests, then their prefill tokens.
    void set(int slot, int64_t requests, int64_t tokens) {
        grow(slot);
        req_[slot] = requests;
        tok_[slot] = tokens;
        present_[slot] = 1;
    }
    // A target that may not be chosen now (unhealthy, draining, excluded): never kept.
    void block(int slot, bool blocked) {
        grow(slot);
        blocked_[slot] = blocked ? 1 : 0;
    }
    // A target gone: no longer a candidate.
    void drop(int slot) {
        if (slot >= 0 && static_cast<size_t>(slot) < present_.size()) present_[slot] = 0;
    }
    bool candidate(int slot) const {
        return slot >= 0 && static_cast<size_t>(slot) < present_.size() && present_[slot] &&
               !blocked_[slot];
    }
    size_t size() const { return present_.size(); }
    int64_t requests(int slot) const { return req_[slot]; }
    int64_t tokens(int slot) const { return tok_[slot]; }
    void seed(uint64_t s) { rng_ = s ? s : 0x9E3779B97F4A7C15ULL; }

    // ``held``: every holder the index matched (any order). Appends to ``out`` the kept
    // ones (their hit) and the kept non-holders (hit 0): in each, the ``k`` least loaded
    // in each of two orders (requests then tokens, as least_load; tokens then requests,
    // the queue a prefill waits behind) and the whole tie class at the k-th key when it
    // has at most ``cap`` members past the k (else a uniform sample of it fills the k).
    // ``also``: slots kept whatever their load (those the policy asks for by name).
    void pick(std::vector<Held>& held, int k, int cap, const std::vector<int>& also,
              std::vector<Held>& out) {
        std::vector<uint8_t> is_holder(present_.size(), 0);
        std::vector<Held> live;
        live.reserve(held.size());
        for (const Held& h : held) {
            if (!candidate(h.slot)) continue;
            is_holder[h.slot] = 1;
            live.push_back(h);
        }
        // by class, deepest first: each class a contiguous run
        std::sort(live.begin(), live.end(), [](const Held& a, const Held& b) {
            if (a.total != b.total) return a.total > b.total;
            if (a.gpu != b.gpu) return a.gpu > b.gpu;
            if (a.cpu != b.cpu) return a.cpu > b.cpu;
            if (a.disk != b.disk) return a.disk > b.disk;
            return a.slot < b.slot;
        });
        std::vector<Held> kept;
        for (size_t i = 0; i < live.size();) {
            size_t j = i + 1;
            while (j < live.size() && live[j].same_class(live[i])) ++j;
            for (int o = 0; o < 2; ++o) least(live.data() + i, j - i, k, cap, o, kept);
            i = j;
        }
        // the targets holding nothing
        std::vector<Held> none;
        none.reserve(present_.size());
        for (size_t s = 0; s < present_.size(); ++s)
            if (present_[s] && !blocked_[s] && !is_holder[s])
                none.push_back(Held{static_cast<int>(s), 0, 0, 0, 0});
        for (int o = 0; o < 2; ++o) least(none.data(), none.size(), k, cap, o, kept);
        for (int slot : also) {
            if (!candidate(slot)) continue;
            Held add{slot, 0, 0, 0, 0};
            for (const Held& h : live)
                if (h.slot == slot) add = h;
            kept.push_back(add);
        }
        std::vector<uint8_t> seen(present_.size(), 0);  // once each
        for (const Held& h : kept) {
            if (seen[h.slot]) continue;
            seen[h.slot] = 1;
            out.push_back(h);
        }
    }

   private:
    std::vector<int64_t> req_, tok_;
    std::vector<uint8_t> present_, blocked_;
    uint64_t rng_ = 0x9E3779B97F4A7C15ULL;

    void grow(int slot) {
        if (slot < 0) return;
        const size_t n = static_cast<size_t>(slot) + 1;
        if (present_.size() < n) {
            req_.resize(n, 0);
            tok_.resize(n, 0);
            present_.resize(n, 0);
            blocked_.resize(n, 0);
        }
    }
    // load order ``o`` (0: requests, then tokens; 1: tokens, then requests)
    bool key_less(int o, int a, int b) const {
        const std::vector<int64_t>& p = o ? tok_ : req_;
        const std::vector<int64_t>& q = o ? req_ : tok_;
        return p[a] != p[b] ? p[a] < p[b] : q[a] < q[b];
    }
    // strict: the slot breaks ties so a sort is deterministic (the tie class is then
    // kept whole or sampled at random, never cut by slot)
    bool less(int o, int a, int b) const {
        if (key_less(o, a, b)) return true;
        if (key_less(o, b, a)) return false;
        return a < b;
    }
    bool same_key(int a, int b) const { return req_[a] == req_[b] && tok_[a] == tok_[b]; }
    // ``run``'s k least in order ``o`` and the tie class at the k-th key, onto ``out``;
    // O(n): only the k-th key matters, everything below it is kept
    void least(const Held* run, size_t n, int k, int cap, int o, std::vector<Held>& out) {
        const size_t want = static_cast<size_t>(k);
        if (n <= want) {
            out.insert(out.end(), run, run + n);
            return;
        }
        std::vector<Held> all(run, run + n);
        auto by = [this, o](const Held& a, const Held& b) { return less(o, a.slot, b.slot); };
        std::nth_element(all.begin(), all.begin() + (want - 1), all.end(), by);
        const int kth = all[want - 1].slot;
        std::vector<Held> head;
        for (const Held& h : all)
            if (!key_less(o, kth, h.slot)) head.push_back(h);  // key <= the k-th's
        std::sort(head.begin(), head.end(), by);
        keep(head.data(), head.size(), k, cap, out);
    }
    uint64_t next() {
        uint64_t x = rng_;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        return rng_ = x;
    }
    // ``run`` sorted by load: the first ``k`` and the tie class at the k-th key
    void keep(Held* run, size_t n, int k, int cap, std::vector<Held>& out) {
        const size_t want = static_cast<size_t>(k);
        if (n <= want) {
            out.insert(out.end(), run, run + n);
            return;
        }
        const int kth = run[want - 1].slot;
        size_t lo = want - 1, hi = want;
        while (lo > 0 && same_key(run[lo - 1].slot, kth)) --lo;
        while (hi < n && same_key(run[hi].slot, kth)) ++hi;
        out.insert(out.end(), run, run + lo);
        const size_t ties = hi - lo, room = want - lo;
        if (ties <= room + static_cast<size_t>(cap)) {
            out.insert(out.end(), run + lo, run + hi);
            return;
        }
        // too many equals: a uniform sample of them (partial Fisher-Yates) fills the k,
        // so over decisions each is as likely as in the whole class
        for (size_t i = 0; i < room; ++i) {
            const size_t j = i + static_cast<size_t>(next() % (ties - i));
            std::swap(run[lo + i], run[lo + j]);
            out.push_back(run[lo + i]);
        }
    }
};

}  // namespace cr
