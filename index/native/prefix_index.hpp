// The bigram-keyed prefix index in native code: the same semantics as
// index/prefix_index.py (its property tests run against both), in far fewer bytes per
// (block, worker) pair.
//
// Layout: one 32 B Node per block {key, held mask, kids mask, parent id + flags, tick} in
// a NodeTable (node_table.hpp: nodes in chunks, found through 4-byte slots). Most blocks
// live in one tier (GPU), so per-tier masks are kept only for blocks that sit in another
// tier too (``split_``). Child counts for the hole accounting are the parent's ``kids``
// (slots holding >= 1 child), with exact counts kept only where a slot holds two or more
// children of one parent (branch points, rare). A node nobody holds stays, as a "ghost"
// with no parent, while some slot holds a child of it; otherwise it is erased.
//
// Measured (bench/scale.py, 1M unshared pairs, 16 workers): the index's heap went from
// 65 B a block (FlatMap of 32 B entries + a FlatMap of 16 B child masks) to ~39 B.
//
// Not thread-safe by itself: the binding holds one mutex per index around each call,
// so a match never sees a half-applied batch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flat_map.hpp"
#include "keyed.hpp"
#include "node_table.hpp"

namespace cr {

using Mask = uint64_t;
constexpr int MAX_SLOTS = 64;
enum Tier : int { GPU = 0, CPU = 1, DISK = 2, SHARED = 3, NTIERS = 4 };

struct Node {
    uint64_t key;
    Mask held;      // slots holding the block in any tier (0: a ghost)
    Mask kids;      // slots holding >= 1 child of it
    uint32_t link;  // parent id (NO_PARENT: none) | SPLIT | IN_SHARED
    uint32_t tick;
};
constexpr uint32_t NO_PARENT = (1u << 30) - 1, SPLIT = 1u << 30, IN_SHARED = 1u << 31;
using Nodes = NodeTable<Node>;
static_assert(Nodes::MAX_NODES < NO_PARENT, "parent ids fit the link field");

struct TierMasks {
    Mask t[NTIERS];
};

using PairHash = KeyedHash;  // keyed.hpp

struct Depths {
    Mask found = 0;
    int depth[MAX_SLOTS];
    void record(Mask m, int d) {
        found |= m;
        while (m) {
            depth[__builtin_ctzll(m)] = d;
            m &= m - 1;
        }
    }
};

struct TierDepths {
    int gpu[MAX_SLOTS], cpu[MAX_SLOTS], disk[MAX_SLOTS];
};

class PrefixCore {
   public:
    PrefixCore(uint64_t max_blocks, int bisect_min_blocks)
        : max_blocks_(max_blocks), bisect_min_(bisect_min_blocks) {
        for (auto& c : counts_) std::fill(c, c + NTIERS, 0);
        std::fill(orphans_, orphans_ + MAX_SLOTS, 0);
    }

    uint64_t dropped = 0, spec_confirmed = 0, spec_expired = 0;
    // Scans of every node: by clears past a slot's log, by eviction rounds (the work a
    // publisher can make the core do, bounded by the stores it sent; tests read them).
    uint64_t clear_scans = 0, evict_scans = 0;

    // -- slots -------------------------------------------------------------------
    void add_slot(int slot) {
        live_ |= bit(slot);
        std::fill(counts_[slot], counts_[slot] + NTIERS, 0);
        set_orphans(slot, 0);
    }
    void drop_slot(int slot) {
        clear(slot);
        live_ &= ~bit(slot);
    }

    // -- events --------------------------------------------------------------------
    void store(int slot, const uint64_t* hashes, size_t n, int tier, bool has_parent,
               uint64_t parent) {
        const Mask b = bit(slot);
        int64_t added = 0, orphans = 0;
        uint32_t pid = has_parent ? nodes_.find(parent) : Nodes::NONE;  // NONE: not made yet
        bool parent_held = !has_parent || (pid != Nodes::NONE && (nodes_.at(pid).held & b));
        for (size_t i = 0; i < n; ++i) {
            const uint64_t h = hashes[i];
            bool inserted;
            const uint32_t id = nodes_.insert(h, inserted);
            Node& e = nodes_.at(id);
            if (!e.held) {
                // New, or a ghost: it takes this store's parent, as a new block would.
                if (has_parent && pid == Nodes::NONE) {
                    pid = nodes_.insert(parent, inserted);
                    if (inserted) nodes_.at(pid).link = NO_PARENT;  // a ghost, for its kids
                }
                e.link = has_parent ? pid : NO_PARENT;
                e.tick = tick_;
                ++blocks_;
            } else if (tier_mask(e, tier) & b) {
                parent = h, has_parent = true, parent_held = true, pid = id;
                continue;
            }
            const bool was_held = e.held & b;
            set_tier(e, tier, b);
            ++added;
            if (!was_held) {
                log_hold(slot, h);
                orphans -= kid_count(slot, e);
                const uint32_t p = e.link & NO_PARENT;
                if (p != NO_PARENT) {
                    kid_inc(slot, p);
                    if (!((has_parent && p == pid) ? parent_held : (nodes_.at(p).held & b)))
                        ++orphans;
                }
                if (spec_.size()) {
                    const Mask* s = spec_.find(h);
                    if (s && (*s & b)) ++spec_confirmed;
                }
            }
            parent = h, has_parent = true, parent_held = true, pid = id;
        }
        if (orphans) set_orphans(slot, orphans_[slot] + orphans);
        counts_[slot][tier] += added;
        if (tier == SHARED) shared_total_ += added;
        if (max_blocks_ && blocks_ > max_blocks_) evict(static_cast<size_t>(max_blocks_ * 0.9));
    }

    void remove(int slot, const uint64_t* hashes, size_t n, int tier) {
        const Mask b = bit(slot);
        int64_t removed = 0;
        for (size_t i = 0; i < n; ++i) {
            const uint32_t id = nodes_.find(hashes[i]);
            if (id == Nodes::NONE) continue;
            Node& e = nodes_.at(id);
            if (!(tier_mask(e, tier) & b)) continue;
            clear_tier(e, tier, b);
            ++removed;
            if (!(e.held & b)) unhold(id, slot);
            if (!e.held) {
                --blocks_;
                settle_node(id);
            }
        }
        counts_[slot][tier] -= removed;
        if (tier == SHARED) shared_total_ -= removed;
    }

    bool holds(int slot, uint64_t h, int tier) {
        const Node* e = nodes_.get(h);
        if (!e) return false;
        return (tier < 0 ? e->held : tier_mask(*e, tier)) & bit(slot);
    }

    // What the slot began to hold since its last clear is logged (up to LOG_CAP keys), so
    // a clear walks those blocks, not the whole core: the clear of a worker that holds
    // nothing costs O(1), of one that stored k blocks since its last clear O(k). A slot
    // past the cap is cleared by a scan of every node, as every clear was until session
    // 16 (a 1 MB batch of 58,000 clears for an empty worker held the mutex for 47 s at
    // 410K blocks); it takes LOG_CAP stores to earn a scan, so no batch pays more than
    // one scan per LOG_CAP blocks it stores.
    void clear(int slot) {
        const Mask b = bit(slot);
        if (spec_marks_[slot]) {
            std::vector<uint64_t> marks;
            spec_.for_each([&](uint64_t key, Mask& m) {
                if (m & b) marks.push_back(key);
            });
            for (uint64_t k : marks) drop_spec(k, slot);
        }
        shared_total_ -= counts_[slot][SHARED];
        std::fill(counts_[slot], counts_[slot] + NTIERS, 0);
        set_orphans(slot, 0);
        std::vector<uint64_t>& log = log_[slot];
        if (log_full_ & b) {
            scan_clear(slot);
        } else {
            std::vector<uint32_t> dead;
            for (uint64_t key : log) {
                const uint32_t id = nodes_.find(key);
                if (id == Nodes::NONE) continue;
                Node& e = nodes_.at(id);
                if (!(e.held & b)) continue;
                drop_holder(e, b);
                dead.push_back(id);
                const uint32_t p = e.link & NO_PARENT;
                if (p != NO_PARENT && nodes_.used(p)) {  // the kid bit its hold set (kid_inc)
                    Node& parent = nodes_.at(p);
                    parent.kids &= ~b;
                    if (!kid_counts_.empty()) kid_counts_.erase({parent.key, slot});
                    dead.push_back(p);
                }
            }
            for (uint32_t id : dead) settle_node(id);
        }
        log_full_ &= ~b;
        log.clear();
        if (log.capacity() > LOG_CAP / 8) std::vector<uint64_t>().swap(log);
    }

    // ``b`` no longer holds ``e`` in any tier.
    void drop_holder(Node& e, Mask b) {
        if (e.link & SPLIT) {
            TierMasks* t = split_.find(e.key);
            for (Mask& m : t->t) m &= ~b;
            settle(e, *t);
        } else {
            e.held &= ~b;
        }
        if (!e.held) --blocks_;
    }

    void scan_clear(int slot) {
        const Mask b = bit(slot);
        ++clear_scans;
        std::vector<uint32_t> dead;
        nodes_.for_each([&](uint32_t id, Node& e) {
            e.kids &= ~b;
            if (e.held & b) drop_holder(e, b);
            if (!e.held) dead.push_back(id);
        });
        for (uint32_t id : dead) settle_node(id);
        for (auto it = kid_counts_.begin(); it != kid_counts_.end();)
            it = it->first.second == slot ? kid_counts_.erase(it) : std::next(it);
    }

    // -- predict-on-route ------------------------------------------------------------
    void predict(int slot, const uint64_t* hashes, size_t n, double expiry) {
        const Mask b = bit(slot);
        for (size_t i = 0; i < n; ++i) {
            bool inserted;
            Mask& m = spec_.get_or_insert(hashes[i], inserted);
            spec_marks_[slot] += !(m & b);
            m |= b;
            spec_expiry_[{hashes[i], slot}] = expiry;
            heap_.push_back(SpecMark{expiry, hashes[i], slot});
            std::push_heap(heap_.begin(), heap_.end(), later);
        }
    }

    // -- matching --------------------------------------------------------------------
    // ``shared_elsewhere`` (n flags, or null): blocks another group's core holds in the
    // shared tier, which every worker here can load as well.
    // ``seeds`` (ascending positions, or null): probed first by the bisect, after block 0
    // (LoadBoard.pick passes the boundaries other groups' walks found: where a group's
    // holders stop at the same blocks, two probes find it instead of a gallop's ~16).
    void depths(const uint64_t* hashes, size_t n, bool speculative, double now, Depths& out,
                const uint8_t* shared_elsewhere = nullptr,
                const std::vector<int64_t>* seeds = nullptr) {
        if (speculative && !heap_.empty()) expire(now);
        const FlatMap<Mask>* spec = speculative && spec_.size() ? &spec_ : nullptr;
        ++tick_;
        const Mask live = live_;
        if (shared_elsewhere) {
            walk(hashes, n, live, spec, out, shared_elsewhere);
            return;
        }
        if (static_cast<int64_t>(n) < bisect_min_ || shared_total_) {
            walk(hashes, n, live, spec, out);
            return;
        }
        const Mask fast = live & ~holey_;
        if (fast) bisect(hashes, n, fast, spec, out, seeds);
        if (live & holey_) walk(hashes, n, live & holey_, spec, out);
    }

    // Slots in ``out.found`` whose hit may span tiers get their per-tier depths in
    // ``tiers``; the mask of those slots is returned (the rest are all-GPU).
    Mask split_tiers(const uint64_t* hashes, size_t n, bool speculative, const Depths& d,
                     TierDepths& tiers, bool shared_elsewhere = false) {
        Mask split = 0;
        int limit = 0;
        for (Mask m = d.found; m; m &= m - 1) {
            const int s = __builtin_ctzll(m);
            if (shared_total_ || shared_elsewhere || counts_[s][CPU] || counts_[s][DISK]) {
                split |= bit(s);
                limit = std::max(limit, d.depth[s]);
            }
        }
        if (split) {
            const FlatMap<Mask>* spec = speculative && spec_.size() ? &spec_ : nullptr;
            walk_tiers(hashes, std::min(n, static_cast<size_t>(limit)), split, spec, tiers);
        }
        return split;
    }

    // Which of ``hashes`` someone holds in the shared tier (0/1 each, into ``out``).
    void shared_at(const uint64_t* hashes, size_t n, uint8_t* out) {
        for (size_t i = 0; i < n; ++i) {
            const Node* e = shared_total_ ? nodes_.get(hashes[i]) : nullptr;
            out[i] = e && (e->link & IN_SHARED);
        }
    }

    // -- stats -------------------------------------------------------------------------
    int64_t shared_total() const { return shared_total_; }
    size_t size() const { return blocks_; }
    size_t speculative() const { return spec_.size(); }
    const int64_t* counts(int slot) const { return counts_[slot]; }
    int holey_count() const { return __builtin_popcountll(holey_); }
    size_t bytes() const {
        size_t logs = 0;
        for (const auto& l : log_) logs += l.capacity() * sizeof(uint64_t);
        return logs + nodes_.bytes() + split_.bytes() + spec_.bytes() +
               kid_counts_.size() * 48 + spec_expiry_.size() * 48 + heap_.capacity() * 24;
    }

   private:
    struct SpecMark {
        double expiry;
        uint64_t key;
        int slot;
    };
    static bool later(const SpecMark& a, const SpecMark& b) { return a.expiry > b.expiry; }
    static Mask bit(int slot) { return Mask{1} << slot; }

    Mask any(const Node& e) const { return (e.link & IN_SHARED) ? ~Mask{0} : e.held; }

    Mask tier_mask(const Node& e, int tier) {
        if (!(e.link & SPLIT)) return tier == GPU ? e.held : 0;
        return split_.find(e.key)->t[tier];
    }

    // Recompute ``held`` and the flags from the per-tier masks; fold back to the
    // GPU-only layout when no other tier is left.
    void settle(Node& e, TierMasks& t) {
        e.held = t.t[GPU] | t.t[CPU] | t.t[DISK] | t.t[SHARED];
        e.link &= ~IN_SHARED;
        if (t.t[SHARED]) e.link |= IN_SHARED;
        if (!(t.t[CPU] | t.t[DISK] | t.t[SHARED])) {
            e.link &= ~SPLIT;
            split_.erase(e.key);
        }
    }

    void set_tier(Node& e, int tier, Mask b) {
        if (tier == GPU && !(e.link & SPLIT)) {
            e.held |= b;
            return;
        }
        bool inserted;
        TierMasks& t = split_.get_or_insert(e.key, inserted);
        if (!(e.link & SPLIT)) {
            t = TierMasks{{e.held, 0, 0, 0}};
            e.link |= SPLIT;
        }
        t.t[tier] |= b;
        settle(e, t);
    }

    void clear_tier(Node& e, int tier, Mask b) {
        if (!(e.link & SPLIT)) {
            if (tier == GPU) e.held &= ~b;
            return;
        }
        TierMasks* t = split_.find(e.key);
        t->t[tier] &= ~b;
        settle(e, *t);
    }

    bool held_by(uint64_t key, Mask b) {
        const Node* e = nodes_.get(key);
        return e && (e->held & b);
    }

    // A node nobody holds: a ghost while some slot holds a child of it (the hole
    // accounting needs its ``kids``), else erased. It forgets its parent either way: a
    // block stored again takes the parent of that store.
    void settle_node(uint32_t id) {
        if (!nodes_.used(id)) return;
        Node& e = nodes_.at(id);
        if (e.held) return;
        e.link = NO_PARENT;
        if (!e.kids) nodes_.erase(id);
    }

    // -- child counts --------------------------------------------------------------
    int64_t kid_count(int slot, const Node& e) {
        if (!(e.kids & bit(slot))) return 0;
        auto it = kid_counts_.find({e.key, slot});
        return it == kid_counts_.end() ? 1 : it->second;
    }
    void kid_inc(int slot, uint32_t pid) {
        Node& p = nodes_.at(pid);
        if (!(p.kids & bit(slot))) {
            p.kids |= bit(slot);
            return;
        }
        auto [it, fresh] = kid_counts_.try_emplace({p.key, slot}, 1);
        ++it->second;
    }
    void kid_dec(int slot, uint32_t pid) {
        Node& p = nodes_.at(pid);
        if (!(p.kids & bit(slot))) return;
        auto it = kid_counts_.find({p.key, slot});
        if (it != kid_counts_.end()) {
            if (--it->second <= 1) kid_counts_.erase(it);
            return;
        }
        p.kids &= ~bit(slot);
        if (!p.kids) settle_node(pid);
    }

    // ``slot`` no longer holds node ``id`` in any tier: its held children become
    // orphans and it stops being one.
    void unhold(uint32_t id, int slot) {
        const Node& e = nodes_.at(id);
        int64_t delta = kid_count(slot, e);
        const uint32_t p = e.link & NO_PARENT;
        if (p != NO_PARENT) {
            kid_dec(slot, p);
            if (!(nodes_.used(p) && (nodes_.at(p).held & bit(slot)))) --delta;
        }
        if (delta) set_orphans(slot, orphans_[slot] + delta);
    }

    void set_orphans(int slot, int64_t n) {
        orphans_[slot] = n;
        if (n)
            holey_ |= bit(slot);
        else
            holey_ &= ~bit(slot);
    }

    // -- predictions -----------------------------------------------------------------
    void expire(double now) {
        while (!heap_.empty() && heap_.front().expiry <= now) {
            std::pop_heap(heap_.begin(), heap_.end(), later);
            SpecMark m = heap_.back();
            heap_.pop_back();
            auto it = spec_expiry_.find({m.key, m.slot});
            if (it != spec_expiry_.end() && it->second == m.expiry) {
                if (!held_by(m.key, bit(m.slot))) ++spec_expired;
                drop_spec(m.key, m.slot);
            }
        }
    }

    void drop_spec(uint64_t key, int slot) {
        Mask* m = spec_.find(key);
        if (m) {
            spec_marks_[slot] -= (*m & bit(slot)) != 0;
            *m &= ~bit(slot);
            if (!*m) spec_.erase(key);
        }
        spec_expiry_.erase({key, slot});
    }

    // -- walks -------------------------------------------------------------------------
    Mask probe(uint64_t h, const FlatMap<Mask>* spec) {
        Mask m = 0;
        Node* e = nodes_.get(h);
        if (e && e->held) {
            m = any(*e);
            e->tick = tick_;
        }
        if (spec) {
            const Mask* s = spec->find(h);
            if (s) m |= *s;
        }
        return m;
    }

    void walk(const uint64_t* hashes, size_t n, Mask active, const FlatMap<Mask>* spec,
              Depths& out, const uint8_t* shared_elsewhere = nullptr) {
        int depth = 0;
        for (size_t i = 0; i < n; ++i) {
            const Mask held = probe(hashes[i], spec);
            const Mask nxt = active & (shared_elsewhere && shared_elsewhere[i] ? ~Mask{0} : held);
            if (nxt != active) {
                if (depth) out.record(active ^ nxt, depth);
                active = nxt;
                if (!active) return;
            }
            ++depth;
        }
        out.record(active, depth);
    }

    // Gallop (probe 0, 1, 3, 7, ...) then bisect: for hole-free slots the holders of
    // block i only shrink as i grows, so an interval whose ends agree needs no probe.
    // With ``seeds``: block 0, then each seed while some slot still holds, then the gallop
    // on from the last one probed; any probes will do, since every interval whose ends
    // differ is bisected.
    void bisect(const uint64_t* hashes, size_t n, Mask active, const FlatMap<Mask>* spec,
                Depths& out, const std::vector<int64_t>* seeds = nullptr) {
        struct Span {
            int64_t lo, hi;
            Mask at_lo, at_hi;
        };
        std::vector<Span> pending;
        int64_t lo = -1, pos = 0, step = 1;
        Mask at_lo = active;
        const int64_t len = static_cast<int64_t>(n);
        if (seeds != nullptr && !seeds->empty()) {
            for (size_t i = 0; at_lo && i <= seeds->size(); ++i) {
                const int64_t p = i == 0 ? 0 : (*seeds)[i - 1];
                if (p <= lo || p >= len) continue;
                const Mask m = probe(hashes[p], spec) & at_lo;
                if (m != at_lo) pending.push_back({lo, p, at_lo, m});
                lo = p, at_lo = m;
            }
            pos = lo + 1;
        }
        while (at_lo) {
            if (pos >= len) {
                pending.push_back({lo, len, at_lo, 0});
                break;
            }
            const Mask m = probe(hashes[pos], spec) & at_lo;
            if (m != at_lo) pending.push_back({lo, pos, at_lo, m});
            lo = pos, at_lo = m, pos += step, step *= 2;
        }
        while (!pending.empty()) {
            Span s = pending.back();
            pending.pop_back();
            if (s.hi - s.lo == 1) {
                if (s.hi) out.record(s.at_lo & ~s.at_hi, static_cast<int>(s.hi));
                continue;
            }
            const int64_t mid = (s.lo + s.hi) >> 1;
            const Mask m = probe(hashes[mid], spec) & s.at_lo;
            if (m != s.at_hi) pending.push_back({mid, s.hi, m, s.at_hi});
            if (m != s.at_lo) pending.push_back({s.lo, mid, s.at_lo, m});
        }
    }

    void walk_tiers(const uint64_t* hashes, size_t n, Mask active, const FlatMap<Mask>* spec,
                    TierDepths& out) {
        Mask a_gpu = active, a_cpu = active, a_disk = active;
        Depths d_gpu, d_cpu, d_disk;
        int depth = 0;
        for (size_t i = 0; i < n; ++i) {
            const uint64_t h = hashes[i];
            Node* e = nodes_.get(h);
            if (e && !e->held) e = nullptr;  // a ghost holds nothing
            Mask s = 0;
            if (spec) {
                const Mask* sp = spec->find(h);
                if (sp) s = *sp;
            }
            if (!e && !s) break;
            Mask m_gpu, m_cpu, m_disk;
            if (!e) {
                m_gpu = m_cpu = m_disk = s;
            } else {
                m_gpu = tier_mask(*e, GPU) | s;
                m_cpu = m_gpu | tier_mask(*e, CPU);
                m_disk = m_cpu | tier_mask(*e, DISK);
            }
            if ((a_disk & m_disk) != a_disk) {
                if (depth) d_disk.record(a_disk & ~m_disk, depth);
                a_disk &= m_disk;
                if (!a_disk) break;
            }
            if ((a_cpu & m_cpu) != a_cpu) {
                if (depth) d_cpu.record(a_cpu & ~m_cpu, depth);
                a_cpu &= m_cpu;
            }
            if ((a_gpu & m_gpu) != a_gpu) {
                if (depth) d_gpu.record(a_gpu & ~m_gpu, depth);
                a_gpu &= m_gpu;
            }
            ++depth;
        }
        if (depth) {
            d_gpu.record(a_gpu, depth);
            d_cpu.record(a_cpu, depth);
            d_disk.record(a_disk, depth);
        }
        for (Mask m = active; m; m &= m - 1) {
            const int sl = __builtin_ctzll(m);
            const Mask b = bit(sl);
            out.gpu[sl] = (d_gpu.found & b) ? d_gpu.depth[sl] : 0;
            out.cpu[sl] = (d_cpu.found & b) ? d_cpu.depth[sl] : 0;
            out.disk[sl] = (d_disk.found & b) ? d_disk.depth[sl] : 0;
        }
    }

    // -- memory --------------------------------------------------------------------------
    static bool is_leaf(const Node& e) { return !(e.kids & e.held); }

    // Least recently matched leaves first, down to ``target``: one scan for the leaves,
    // then a min-heap by (tick, key) that a parent joins when its last held child goes
    // (it is a leaf then). Until session 16 each round rescanned every node and took
    // only the leaves of that moment, so a chain (one leaf) cost a scan per block: a
    // worker past its quota with chained blocks made eviction O(excess x N).
    void evict(size_t target) {
        struct Aged {
            uint32_t tick;
            uint64_t key;
            uint32_t id;
            bool operator>(const Aged& o) const { return tick != o.tick ? tick > o.tick : key > o.key; }
        };
        std::vector<Aged> heap;
        const auto older = std::greater<Aged>();
        while (blocks_ > target) {
            ++evict_scans;
            heap.clear();
            nodes_.for_each([&](uint32_t id, Node& e) {
                if (e.held && is_leaf(e)) heap.push_back({e.tick, e.key, id});
            });
            const bool leaves = !heap.empty();
            if (!leaves)  // every held node has a held child: a cycle of crafted hashes
                nodes_.for_each([&](uint32_t id, Node& e) {
                    if (e.held) heap.push_back({e.tick, e.key, id});
                });
            std::make_heap(heap.begin(), heap.end(), older);
            uint64_t taken = 0;
            while (blocks_ > target && !heap.empty()) {
                std::pop_heap(heap.begin(), heap.end(), older);
                const Aged a = heap.back();
                heap.pop_back();
                if (!nodes_.used(a.id)) continue;
                Node& e = nodes_.at(a.id);
                if (e.key != a.key || !e.held) continue;
                const uint32_t p = e.link & NO_PARENT;
                const bool parent_was_leaf =
                    p == NO_PARENT || !nodes_.used(p) || is_leaf(nodes_.at(p));
                drop_node(a.id);
                ++taken;
                if (leaves && !parent_was_leaf && nodes_.used(p)) {
                    const Node& q = nodes_.at(p);
                    if (q.held && is_leaf(q)) {
                        heap.push_back({q.tick, q.key, p});
                        std::push_heap(heap.begin(), heap.end(), older);
                    }
                }
            }
            dropped += taken;
        }
    }

    // Every holder of node ``id`` lets it go (the eviction of one block).
    void drop_node(uint32_t id) {
        Node& e = nodes_.at(id);
        for (int t = 0; t < NTIERS; ++t) {
            for (Mask m = tier_mask(e, t); m; m &= m - 1) {
                --counts_[__builtin_ctzll(m)][t];
                if (t == SHARED) --shared_total_;
            }
        }
        for (Mask m = e.held; m; m &= m - 1) unhold(id, __builtin_ctzll(m));
        if (e.link & SPLIT) split_.erase(e.key);
        e.held = 0;
        e.link &= NO_PARENT;
        --blocks_;
        settle_node(id);
    }

    void log_hold(int slot, uint64_t key) {
        if (log_full_ & bit(slot)) return;
        if (log_[slot].size() >= LOG_CAP) {
            log_full_ |= bit(slot);
            std::vector<uint64_t>().swap(log_[slot]);
            return;
        }
        log_[slot].push_back(key);
    }

    static constexpr size_t LOG_CAP = 8192;  // keys a slot logs (64 KB) before clears scan

    uint64_t max_blocks_;
    int64_t bisect_min_;
    std::vector<uint64_t> log_[MAX_SLOTS];  // keys each slot began to hold since its clear
    Mask log_full_ = 0;                     // slots past LOG_CAP: their clear scans
    int64_t spec_marks_[MAX_SLOTS] = {};    // predictions each slot has in spec_
    uint32_t tick_ = 0;
    Mask live_ = 0, holey_ = 0;
    int64_t counts_[MAX_SLOTS][NTIERS];
    int64_t orphans_[MAX_SLOTS];
    int64_t shared_total_ = 0;
    size_t blocks_ = 0;  // nodes someone holds (the rest are ghosts)
    Nodes nodes_;
    FlatMap<TierMasks> split_;
    std::unordered_map<std::pair<uint64_t, int>, int64_t, PairHash> kid_counts_;  // when >= 2
    FlatMap<Mask> spec_;
    std::unordered_map<std::pair<uint64_t, int>, double, PairHash> spec_expiry_;
    std::vector<SpecMark> heap_;
};

}  // namespace cr
