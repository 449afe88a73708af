// Nodes by 64-bit key: the nodes live in fixed chunks that never move (a node's 4-byte
// id stays valid until it is erased, growth copies nothing and leaves no 2x vector
// slack), found through an IdIndex: an open-addressing table of 4-byte slots, each an id
// and 5 bits of the key's hash (a probe reads a node only on a tag match: 1 in 32 of the
// others).
//
// Why: per-(block, worker) bytes. A FlatMap slot holding the node inline pays its empty
// slots at the node's size (32 B at a mean load of ~0.65: ~49 B a block); here an empty
// slot costs 4 B and a node exactly its size (32 B + ~6 B a block). Linear probing,
// backward-shift deletion; the table grows by 1.5x at a load of 0.75. At 0.85 (before
// session 10) a miss near the top of the cycle probed ~23 slots: with the load at 0.75
// and a miss probed once (``seek``/``place``), a store of new blocks ran 26 % fewer
// instructions (callgrind, EventApplier::apply, 100K pairs: 1,395 -> 1,030 a block)
// for ~5 B more a (block, worker) pair (bench/scale.py memory, 1M pairs: 65 -> 70 B).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "keyed.hpp"

namespace cr {

// Ids by key, the key of an id read through ``key_of(id)`` (the table keeps no keys).
class IdIndex {
   public:
    static constexpr uint32_t NONE = 0xFFFFFFFFu;
    static constexpr int ID_BITS = 27;
    static constexpr uint32_t ID_MASK = (1u << ID_BITS) - 1;
    static constexpr uint32_t MAX_IDS = ID_MASK - 1;  // slot = tag << 27 | (id + 1)

    size_t size() const { return size_; }
    size_t bytes() const { return slots_.capacity() * sizeof(uint32_t); }
    bool full() const { return (size_ + 1) * 4 > slots_.size() * 3; }
    size_t next_capacity() const { return slots_.size() < 16 ? 16 : slots_.size() * 3 / 2; }

    template <class K>
    uint32_t find(uint64_t key, const K& key_of) const {
        const size_t i = locate(key, key_of);
        return i == NPOS ? NONE : (slots_[i] & ID_MASK) - 1;
    }

    // Adds ``key`` -> ``id`` (the caller checked ``full()`` first and grew); ``key``
    // must be absent.
    void add(uint64_t key, uint32_t id) {
        const uint64_t h = mix(key);
        size_t i = home(h);
        while (slots_[i]) i = next(i);
        slots_[i] = (tag_of(h) << ID_BITS) | (id + 1);
        ++size_;
    }

    // ``key``'s slot (``found``), or the empty slot that ends its probe run: where
    // ``place`` puts it, so a miss is probed once, not again by ``add`` (for a new
    // block: 2 probe runs of the 4 a store made; see WorkerBlocks::store). The table
    // must have slots; it always has an empty one (it grows before it is ``full()``).
    template <class K>
    size_t seek(uint64_t key, const K& key_of, bool& found) const {
        const uint64_t h = mix(key);
        const uint32_t tag = tag_of(h);
        for (size_t i = home(h);; i = next(i)) {
            const uint32_t s = slots_[i];
            if (!s || ((s >> ID_BITS) == tag && key_of((s & ID_MASK) - 1) == key)) {
                found = s != 0;
                return i;
            }
        }
    }
    uint32_t id_at(size_t slot) const { return (slots_[slot] & ID_MASK) - 1; }
    void place(size_t slot, uint64_t key, uint32_t id) {
        slots_[slot] = (tag_of(mix(key)) << ID_BITS) | (id + 1);
        ++size_;
    }

    // Points ``key`` at ``id``, replacing what it pointed at; grows when needed (before
    // the probe, so the slot it finds stays valid: at most one insert early).
    template <class K>
    void put(uint64_t key, uint32_t id, const K& key_of) {
        if (full()) regrow(key_of);
        bool found;
        const size_t i = seek(key, key_of, found);
        if (found)
            slots_[i] = (slots_[i] & ~ID_MASK) | (id + 1);
        else
            place(i, key, id);
    }

    // The id ``key`` pointed at (now unlinked), or NONE.
    template <class K>
    uint32_t erase(uint64_t key, const K& key_of) {
        size_t i = locate(key, key_of);
        if (i == NPOS) return NONE;
        const uint32_t id = (slots_[i] & ID_MASK) - 1;
        // Backward shift: pull later members of the probe run into the hole.
        for (size_t j = i;;) {
            j = next(j);
            const uint32_t s = slots_[j];
            if (!s) break;
            const size_t k = home(mix(key_of((s & ID_MASK) - 1)));
            const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
            if (stays) continue;
            slots_[i] = s;
            i = j;
        }
        slots_[i] = 0;
        --size_;
        return id;
    }

    // A new table of ``cap`` slots holding the ids ``each_id`` hands out (in the order
    // of the nodes themselves: sequential reads).
    template <class K, class Each>
    void rebuild(size_t cap, const K& key_of, const Each& each_id) {
        std::vector<uint32_t>(cap, 0).swap(slots_);
        size_ = 0;
        each_id([&](uint32_t id) { add(key_of(id), id); });
    }

    void clear() {
        std::vector<uint32_t>().swap(slots_);
        size_ = 0;
    }

   private:
    static constexpr size_t NPOS = ~size_t{0};

    // Keyed per process (keyed.hpp): MurmurHash3's finalizer, which it replaced, is a
    // public bijection, so a publisher could pick engine hashes that share a probe run.
    static uint64_t mix(uint64_t k) { return keyed_mix(k); }
    static uint32_t tag_of(uint64_t h) { return static_cast<uint32_t>(h & 31); }
    size_t home(uint64_t h) const {
        return static_cast<size_t>((static_cast<__uint128_t>(h) * slots_.size()) >> 64);
    }
    size_t next(size_t i) const { return i + 1 == slots_.size() ? 0 : i + 1; }

    template <class K>
    size_t locate(uint64_t key, const K& key_of) const {
        if (slots_.empty()) return NPOS;
        bool found;
        const size_t i = seek(key, key_of, found);
        return found ? i : NPOS;
    }

    // Grown from its own slots (for an index that does not hold every node).
    template <class K>
    void regrow(const K& key_of) {
        std::vector<uint32_t> old;
        old.swap(slots_);
        slots_.assign(old.size() < 16 ? 16 : old.size() * 3 / 2, 0);
        size_ = 0;
        for (uint32_t s : old)
            if (s) add(key_of((s & ID_MASK) - 1), (s & ID_MASK) - 1);
    }

    std::vector<uint32_t> slots_;
    size_t size_ = 0;
};

// Nodes in chunks plus an IdIndex over their ``key`` (``Node`` must have a
// ``uint64_t key``).
template <class Node>
class NodeTable {
   public:
    static constexpr uint32_t NONE = IdIndex::NONE;
    static constexpr uint32_t MAX_NODES = IdIndex::MAX_IDS;

    size_t size() const { return index_.size(); }
    size_t bytes() const {
        return index_.bytes() + chunks_.size() * CHUNK * sizeof(Node) +
               chunks_.capacity() * sizeof(void*) + free_.capacity() * sizeof(uint32_t) +
               used_.capacity() * sizeof(uint64_t);
    }

    Node& at(uint32_t id) { return chunks_[id >> CHUNK_BITS][id & (CHUNK - 1)]; }
    const Node& at(uint32_t id) const { return chunks_[id >> CHUNK_BITS][id & (CHUNK - 1)]; }
    bool used(uint32_t id) const { return id < top_ && (used_[id >> 6] >> (id & 63)) & 1; }

    uint32_t find(uint64_t key) const { return index_.find(key, key_of()); }

    Node* get(uint64_t key) {
        const uint32_t id = find(key);
        return id == NONE ? nullptr : &at(id);
    }

    // The id of ``key``'s node; a new one (value-initialized but for the key) when absent.
    uint32_t insert(uint64_t key, bool& inserted) {
        if (index_.full())  // before the probe (IdIndex::put says why)
            index_.rebuild(index_.next_capacity(), key_of(), [&](auto add) {
                for_each([&](uint32_t i, Node&) { add(i); });
            });
        bool found;
        const size_t slot = index_.seek(key, key_of(), found);
        inserted = !found;
        if (found) return index_.id_at(slot);
        const uint32_t id = allocate();
        Node& n = at(id);
        n = Node{};
        n.key = key;
        index_.place(slot, key, id);
        return id;
    }

    void erase(uint32_t id) {
        index_.erase(at(id).key, key_of());
        used_[id >> 6] &= ~(uint64_t{1} << (id & 63));
        free_.push_back(id);
    }

    // ``f(id, node)`` for every node; ``f`` must not insert or erase.
    template <class F>
    void for_each(F&& f) {
        for (uint32_t w = 0; w < used_.size(); ++w)
            for (uint64_t m = used_[w]; m; m &= m - 1) {
                const uint32_t id = w * 64 + static_cast<uint32_t>(__builtin_ctzll(m));
                f(id, at(id));
            }
    }

    void clear() {
        index_.clear();
        chunks_.clear();
        std::vector<uint32_t>().swap(free_);
        std::vector<uint64_t>().swap(used_);
        top_ = 0;
    }

   private:
    static constexpr int CHUNK_BITS = 14;  // 16K nodes a chunk
    static constexpr uint32_t CHUNK = 1u << CHUNK_BITS;

    auto key_of() const {
        return [this](uint32_t id) -> uint64_t { return at(id).key; };
    }

    uint32_t allocate() {
        uint32_t id;
        if (!free_.empty()) {
            id = free_.back();
            free_.pop_back();
        } else {
            if (top_ >= MAX_NODES) throw std::length_error("a native table holds at most 2**27 - 2 keys");
            id = top_++;
            if ((id >> CHUNK_BITS) >= chunks_.size()) chunks_.emplace_back(new Node[CHUNK]);
            if ((id >> 6) >= used_.size()) used_.push_back(0);
        }
        used_[id >> 6] |= uint64_t{1} << (id & 63);
        return id;
    }

    IdIndex index_;
    std::vector<std::unique_ptr<Node[]>> chunks_;
    std::vector<uint32_t> free_;
    std::vector<uint64_t> used_;  // bit per id: in use
    uint32_t top_ = 0;            // ids below it were handed out once
};

}  // namespace cr
