// The candidates that can win a routing decision in a wide pool: the least loaded few of
// every class of holders (same leading blocks held in every tier) and of the targets that
// hold nothing, out of a board of per-target load keys kept current as loads move.
//
// A policy's cost for a candidate grows with its load and falls with its hit; between
// two candidates with the same hit, the less loaded one costs no more. So the winner is
// among the least loaded of its hit class, and a class's more loaded members need no
// view built and no cost computed (router/routing/prune.py says when this holds and what
// happens when it does not). Work per decision: the index walk, then two linear passes
// over the targets per order here; Python sees only the few kept (17 to 23 of 1,024
// targets in bench/scale.py --only targets).
//
// A policy that does not weigh hits (least_load) needs no walk and no class: ``least``
// keeps the least loaded of the whole pool from a min tree per order (each node: the least
// key under it and how many leaves hold it), kept current by ``set``/``block``/``drop``
// in O(log n). A decision then costs O((k + cap) log n), not a pass over every target.
#pragma once

#include <algorithm>
#include <cstddef>
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
        // each order's key one integer (compared without looking the loads up): requests
        // below 2**23 and tokens below 2**40 keep their order, larger ones clamp
        const uint64_t r = static_cast<uint64_t>(std::clamp<int64_t>(requests, 0, (1LL << 23) - 1));
        const uint64_t t = static_cast<uint64_t>(std::clamp<int64_t>(tokens, 0, (1LL << 40) - 1));
        key_[0][slot] = (r << 40) | t;
        key_[1][slot] = (t << 23) | r;
        present_[slot] = 1;
        refresh(static_cast<size_t>(slot));
    }
    // A target that may not be chosen now (unhealthy, draining, excluded): never kept.
    void block(int slot, bool blocked) {
        grow(slot);
        blocked_[slot] = blocked ? 1 : 0;
        if (slot >= 0) refresh(static_cast<size_t>(slot));
    }
    // A target gone: no longer a candidate.
    void drop(int slot) {
        if (slot >= 0 && static_cast<size_t>(slot) < present_.size()) {
            present_[slot] = 0;
            refresh(static_cast<size_t>(slot));
        }
    }
    bool candidate(int slot) const {
        return slot >= 0 && static_cast<size_t>(slot) < present_.size() && present_[slot] &&
               !blocked_[slot];
    }
    // The slot's place in the caller's candidate order: ``pick`` and ``least`` hand out
    // their slots in it (a slot never placed: its own number), so the caller need not
    // sort them (ties break in candidate order in the policies).
    void place(int slot, int64_t rank) {
        grow(slot);
        if (slot >= 0) rank_[slot] = rank;
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
        const size_t from = out.size();
        const uint32_t ep = next_epoch();  // mark_[s] == ep: a holder; stamp_[s] == ep: kept
        std::vector<Held> live;
        live.reserve(held.size());
        for (const Held& h : held) {
            if (!candidate(h.slot)) continue;
            mark_[h.slot] = ep;
            live.push_back(h);
        }
        // by class, deepest first: each class a contiguous run, slots ascending in it
        by_class(live);
        std::vector<Held> kept;
        for (size_t i = 0; i < live.size();) {
            size_t j = i + 1;
            while (j < live.size() && live[j].same_class(live[i])) ++j;
            for (int o = 0; o < 2; ++o) least(live.data() + i, j - i, k, cap, o, kept);
            i = j;
        }
        // the targets holding nothing: from the min trees, passing over the holders met
        // there; a pass over every target only where the trees would cost more (many
        // holders among the least loaded)
        std::vector<int> idle;
        std::vector<Held> none;
        for (int o = 0; o < 2; ++o) {
            if (least_tree(o, static_cast<size_t>(k), static_cast<size_t>(cap), idle, &live, ep))
                continue;
            if (none.empty()) {
                none.reserve(present_.size());
                for (size_t s = 0; s < present_.size(); ++s)
                    if (present_[s] && !blocked_[s] && mark_[s] != ep)
                        none.push_back(Held{static_cast<int>(s), 0, 0, 0, 0});
            }
            least(none.data(), none.size(), k, cap, o, kept);
        }
        for (int slot : idle) kept.push_back(Held{slot, 0, 0, 0, 0});
        for (int slot : also) {
            if (!candidate(slot)) continue;
            Held add{slot, 0, 0, 0, 0};
            for (const Held& h : live)
                if (h.slot == slot) add = h;
            kept.push_back(add);
        }
        for (const Held& h : kept) {  // once each
            if (stamp_[h.slot] == ep) continue;
            stamp_[h.slot] = ep;
            out.push_back(h);
        }
        std::sort(out.begin() + static_cast<std::ptrdiff_t>(from), out.end(),
                  [this](const Held& a, const Held& b) { return rank_[a.slot] < rank_[b.slot]; });
    }

    // The pool's least loaded without any walk (a policy that does not weigh hits): onto
    // ``out``, the ``k`` least in each of the two orders and the tie class at the k-th key
    // (whole when at most ``cap`` more, else a uniform sample fills the k), as ``pick``
    // keeps among the targets holding nothing, then the ``also`` slots; each once.
    // O((k + cap) log n) from the min trees, none of it a pass over the targets.
    void least(int k, int cap, const std::vector<int>& also, std::vector<int>& out) {
        const size_t from = out.size();
        const uint32_t ep = next_epoch();
        for (int o = 0; o < 2; ++o)
            least_tree(o, static_cast<size_t>(k), static_cast<size_t>(cap), out, nullptr, ep);
        for (int slot : also)
            if (candidate(slot)) out.push_back(slot);
        size_t w = from;  // once each: a stamp per slot, no pass to clear it
        for (size_t i = from; i < out.size(); ++i) {
            const size_t s = static_cast<size_t>(out[i]);
            if (stamp_[s] == ep) continue;
            stamp_[s] = ep;
            out[w++] = out[i];
        }
        out.resize(w);
        std::sort(out.begin() + static_cast<std::ptrdiff_t>(from), out.end(),
                  [this](int a, int b) { return rank_[a] < rank_[b]; });
    }

   private:
    static constexpr uint64_t NONE = ~uint64_t{0};  // a leaf no one may pick
    std::vector<int64_t> req_, tok_;
    std::vector<uint64_t> key_[2];  // per order, per slot (``set``)
    std::vector<uint8_t> present_, blocked_;
    std::vector<int64_t> rank_;  // per slot, its place in the candidate order (``place``)
    uint64_t rng_ = 0x9E3779B97F4A7C15ULL;
    // per order, a min tree over the slots: node i's children 2i and 2i+1, leaf of slot s
    // at leaves_ + s (its key, NONE when absent or blocked); cnt_: the leaves under a node
    // holding its minimum (0 under NONE)
    size_t leaves_ = 0;  // a power of two, at least every slot
    std::vector<uint64_t> min_[2];
    std::vector<uint32_t> cnt_[2];
    std::vector<uint32_t> stamp_, mark_;  // per call (its epoch): kept once; a holder
    uint32_t epoch_ = 0;

    uint32_t next_epoch() {  // marks of earlier calls are stale, no pass to clear them
        if (++epoch_ == 0) {
            std::fill(stamp_.begin(), stamp_.end(), 0);
            std::fill(mark_.begin(), mark_.end(), 0);
            epoch_ = 1;
        }
        return epoch_;
    }

    void grow(int slot) {
        if (slot < 0) return;
        const size_t n = static_cast<size_t>(slot) + 1;
        if (present_.size() < n) {
            req_.resize(n, 0);
            tok_.resize(n, 0);
            key_[0].resize(n, 0);
            key_[1].resize(n, 0);
            present_.resize(n, 0);
            blocked_.resize(n, 0);
            stamp_.resize(n, 0);
            mark_.resize(n, 0);
            for (size_t s = rank_.size(); s < n; ++s) rank_.push_back(static_cast<int64_t>(s));
        }
        if (n > leaves_) {  // a larger tree, rebuilt from the leaves: O(n), once a doubling
            size_t cap = leaves_ ? leaves_ : 64;
            while (cap < n) cap <<= 1;
            leaves_ = cap;
            for (int o = 0; o < 2; ++o) {
                min_[o].assign(2 * cap, NONE);
                cnt_[o].assign(2 * cap, 0);
                for (size_t s = 0; s < present_.size(); ++s) {
                    const uint64_t v = value(o, s);
                    min_[o][cap + s] = v;
                    cnt_[o][cap + s] = v == NONE ? 0 : 1;
                }
                for (size_t i = cap - 1; i >= 1; --i) pull(o, i);
            }
        }
    }
    uint64_t value(int o, size_t s) const {
        return present_[s] && !blocked_[s] ? key_[o][s] : NONE;
    }
    void pull(int o, size_t i) {
        const uint64_t a = min_[o][2 * i], b = min_[o][2 * i + 1];
        const uint64_t m = a < b ? a : b;
        min_[o][i] = m;
        cnt_[o][i] = m == NONE ? 0 : (a == m ? cnt_[o][2 * i] : 0) + (b == m ? cnt_[o][2 * i + 1] : 0);
    }
    void put(int o, size_t s, uint64_t v) {
        size_t i = leaves_ + s;
        min_[o][i] = v;
        cnt_[o][i] = v == NONE ? 0 : 1;
        for (i >>= 1; i >= 1; i >>= 1) pull(o, i);
    }
    void refresh(size_t s) {
        if (s >= present_.size()) return;
        put(0, s, value(0, s));
        put(1, s, value(1, s));
    }
    // the ``r``-th leaf, in slot order, of those holding the tree's least key
    size_t select(int o, uint32_t r) const {
        const uint64_t m = min_[o][1];
        size_t i = 1;
        while (i < leaves_) {
            const size_t l = 2 * i;
            if (min_[o][l] == m) {
                if (r < cnt_[o][l]) {
                    i = l;
                    continue;
                }
                r -= cnt_[o][l];
            }
            i = l + 1;
        }
        return i - leaves_;
    }
    // The k least of order ``o`` from its tree and the tie at the k-th key, as ``least``
    // below keeps them from a run: leaves are taken least first, each hidden (NONE) once
    // taken so the next least is the tree's minimum, and shown again after. ``holders``
    // (marked ``mark_[s] == ep``): passed over, hidden where met (a holder drawn from a
    // tie is drawn again: the draw stays uniform over the others). False, with nothing
    // added, when the holders met would cost more than a pass over every target.
    bool least_tree(int o, size_t want, size_t cap, std::vector<int>& out,
                    const std::vector<Held>* holders, uint32_t ep) {
        if (!leaves_) return true;
        // holders past half the pool: the pass is the cheaper (their scan at each key)
        if (holders != nullptr && 2 * holders->size() > present_.size()) return false;
        const size_t from = out.size();
        size_t depth = 1;
        while ((size_t{1} << depth) < leaves_) ++depth;
        // work in tree steps (a hide or a show: ``depth`` each) and holders scanned; no
        // bound without holders (at most k + cap hides a key, k keys)
        const size_t budget = holders != nullptr ? 4 * present_.size() : SIZE_MAX;
        size_t work = 0;
        std::vector<size_t> hidden;
        auto hide = [&](size_t s) {
            hidden.push_back(s);
            put(o, s, NONE);
            work += 2 * depth;
        };
        auto holder = [&](size_t s) { return holders != nullptr && mark_[s] == ep; };
        bool ok = true;
        size_t have = 0;
        while (ok && have < want && min_[o][1] != NONE) {
            const uint64_t v = min_[o][1];
            const size_t c = cnt_[o][1];  // the leaves at the least key left
            const size_t room = want - have;
            // holders among them: counted only where the key's leaves are more than
            // could be kept whole (a scan of every holder, which ran at each key)
            size_t held_here = 0;
            if (holders != nullptr && c > room + cap) {
                for (const Held& h : *holders) held_here += key_[o][h.slot] == v;
                work += holders->size();
            }
            const size_t open = c - held_here;
            if (open <= room + cap) {  // below the k-th key, or the tie at it kept whole
                size_t taken = 0;  // the key's leaves that hold nothing (``open`` exactly)
                for (size_t i = 0; i < c && ok; ++i) {
                    const size_t s = select(o, 0);
                    hide(s);
                    if (!holder(s)) {
                        out.push_back(static_cast<int>(s));
                        ++taken;
                    }
                    ok = work <= budget;
                }
                have += taken;
                continue;
            }
            size_t left = c;  // a uniform sample of the tie fills the k
            for (size_t taken = 0; taken < room && ok;) {
                const size_t s = select(o, static_cast<uint32_t>(next() % left));
                hide(s);
                --left;
                if (!holder(s)) {
                    out.push_back(static_cast<int>(s));
                    ++taken;
                }
                ok = work <= budget;
            }
            break;
        }
        for (size_t s : hidden) put(o, s, value(o, s));
        if (!ok) out.resize(from);
        return ok;
    }
    static bool deeper(const Held& a, const Held& b) {
        if (a.total != b.total) return a.total > b.total;
        if (a.gpu != b.gpu) return a.gpu > b.gpu;
        if (a.cpu != b.cpu) return a.cpu > b.cpu;
        return a.disk > b.disk;
    }
    // ``live`` ordered by class, deepest first, then by slot: as a sort by (class, slot)
    // orders it. The holders are few classes (a prefix's holders share one; bench/
    // scale.py: ~3 among 327 at 1,024 targets), so each is found among those seen and
    // the run is placed by a counting sort (a sort of every holder was ~1/6 of a pick's
    // samples there under perf); with many classes, the sort. ``live`` comes in slot order (the groups'
    // walks, each slot's bit in turn), which the counting sort keeps.
    static void by_class(std::vector<Held>& live) {
        constexpr size_t FEW = 16;
        Held kinds[FEW];
        size_t nk = 0, last = 0;
        std::vector<uint8_t> kind(live.size());
        bool ordered = true;  // slots ascending (kept by the counting sort)
        for (size_t i = 0; i < live.size(); ++i) {
            const Held& h = live[i];
            if (i && live[i - 1].slot > h.slot) ordered = false;
            if (nk && kinds[last].same_class(h)) {
                kind[i] = static_cast<uint8_t>(last);
                continue;
            }
            size_t j = 0;
            while (j < nk && !kinds[j].same_class(h)) ++j;
            if (j == nk) {
                if (nk == FEW) {
                    ordered = false;
                    break;
                }
                kinds[nk++] = h;
            }
            kind[i] = static_cast<uint8_t>(last = j);
        }
        if (!ordered) {
            std::sort(live.begin(), live.end(), [](const Held& a, const Held& b) {
                if (!a.same_class(b)) return deeper(a, b);
                return a.slot < b.slot;
            });
            return;
        }
        size_t rank[FEW], order[FEW], start[FEW + 1] = {0};
        for (size_t j = 0; j < nk; ++j) order[j] = j;
        std::sort(order, order + nk, [&](size_t a, size_t b) { return deeper(kinds[a], kinds[b]); });
        for (size_t r = 0; r < nk; ++r) rank[order[r]] = r;
        for (size_t i = 0; i < live.size(); ++i) ++start[rank[kind[i]] + 1];
        for (size_t r = 0; r < nk; ++r) start[r + 1] += start[r];
        std::vector<Held> out(live.size());
        for (size_t i = 0; i < live.size(); ++i) out[start[rank[kind[i]]]++] = live[i];
        live.swap(out);
    }

    uint64_t next() {
        uint64_t x = rng_;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        return rng_ = x;
    }
    // ``run``'s ``k`` least in order ``o`` (0: requests, then tokens; 1: tokens, then
    // requests) and the tie class at the k-th key, onto ``out``: whole when it has at most
    // ``cap`` members past the k, else a uniform sample of it (partial Fisher-Yates) fills
    // the k, so over decisions each is as likely as in the whole class. Two passes, no sort.
    void least(const Held* run, size_t n, int k, int cap, int o, std::vector<Held>& out) {
        const size_t want = static_cast<size_t>(k);
        if (n <= want) {
            out.insert(out.end(), run, run + n);
            return;
        }
        const uint64_t* key = key_[o].data();
        uint64_t best[64];  // the k least keys, ascending (k <= 64)
        size_t have = 0;
        for (size_t i = 0; i < n; ++i) {
            const uint64_t v = key[run[i].slot];
            if (have == want && v >= best[want - 1]) continue;
            size_t j = have < want ? have++ : want - 1;
            while (j > 0 && best[j - 1] > v) {
                best[j] = best[j - 1];
                --j;
            }
            best[j] = v;
        }
        const uint64_t kth = best[want - 1];
        std::vector<Held> ties;
        size_t below = 0;
        for (size_t i = 0; i < n; ++i) {
            const uint64_t v = key[run[i].slot];
            if (v < kth) {
                out.push_back(run[i]);
                ++below;
            } else if (v == kth) {
                ties.push_back(run[i]);
            }
        }
        const size_t room = want - below;
        if (ties.size() <= room + static_cast<size_t>(cap)) {
            out.insert(out.end(), ties.begin(), ties.end());
            return;
        }
        for (size_t i = 0; i < room; ++i) {
            const size_t j = i + static_cast<size_t>(next() % (ties.size() - i));
            std::swap(ties[i], ties[j]);
            out.push_back(ties[i]);
        }
    }
};

}  // namespace cr
