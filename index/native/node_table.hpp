// Nodes by 64-bit key: the nodes live in fixed chunks that never move (a node's 4-byte
// id stays valid until it is erased, growth copies nothing and leaves no 2x vector
// slack), found through an open-addressing table of 4-byte slots, each an id and 5 bits
// of the key's hash (a probe reads a node only on a tag match: 1 in 32 of the others).
//
// Why: the index's per-(block, worker) bytes. A FlatMap slot holding the node inline
// pays its empty slots at the node's size (32 B at a mean load of ~0.65: ~49 B a block);
// here an empty slot costs 4 B and a node exactly its size (32 B + ~6 B a block).
// Linear probing, backward-shift deletion; the table grows by 1.5x at a load of 0.85.
// ``Node`` must have a ``uint64_t key``.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

namespace cr {

template <class Node>
class NodeTable {
   public:
    static constexpr uint32_t NONE = 0xFFFFFFFFu;
    static constexpr int ID_BITS = 27;
    static constexpr uint32_t ID_MASK = (1u << ID_BITS) - 1;
    static constexpr uint32_t MAX_NODES = ID_MASK - 1;  // slot = tag << 27 | (id + 1)

    size_t size() const { return size_; }
    size_t bytes() const {
        return slots_.capacity() * sizeof(uint32_t) + chunks_.size() * CHUNK * sizeof(Node) +
               chunks_.capacity() * sizeof(void*) + free_.capacity() * sizeof(uint32_t) +
               used_.capacity() * sizeof(uint64_t);
    }

    Node& at(uint32_t id) { return chunks_[id >> CHUNK_BITS][id & (CHUNK - 1)]; }
    const Node& at(uint32_t id) const { return chunks_[id >> CHUNK_BITS][id & (CHUNK - 1)]; }
    bool used(uint32_t id) const { return id < top_ && (used_[id >> 6] >> (id & 63)) & 1; }

    uint32_t find(uint64_t key) const {
        if (slots_.empty()) return NONE;
        const uint64_t h = mix(key);
        const uint32_t tag = tag_of(h);
        const size_t cap = slots_.size();
        for (size_t i = home(h); ; i = i + 1 == cap ? 0 : i + 1) {
            const uint32_t s = slots_[i];
            if (!s) return NONE;
            if ((s >> ID_BITS) == tag && at((s & ID_MASK) - 1).key == key) return (s & ID_MASK) - 1;
        }
    }

    Node* get(uint64_t key) {
        const uint32_t id = find(key);
        return id == NONE ? nullptr : &at(id);
    }

    // The id of ``key``'s node; a new one (value-initialized but for the key) when absent.
    uint32_t insert(uint64_t key, bool& inserted) {
        if ((size_ + 1) * 20 > slots_.size() * 17) rehash(slots_.size() < 16 ? 16 : slots_.size() * 3 / 2);
        const uint64_t h = mix(key);
        const uint32_t tag = tag_of(h);
        const size_t cap = slots_.size();
        size_t i = home(h);
        for (;; i = i + 1 == cap ? 0 : i + 1) {
            const uint32_t s = slots_[i];
            if (!s) break;
            if ((s >> ID_BITS) == tag && at((s & ID_MASK) - 1).key == key) {
                inserted = false;
                return (s & ID_MASK) - 1;
            }
        }
        const uint32_t id = allocate();
        Node& n = at(id);
        n = Node{};
        n.key = key;
        slots_[i] = (tag << ID_BITS) | (id + 1);
        ++size_;
        inserted = true;
        return id;
    }

    void erase(uint32_t id) {
        const size_t cap = slots_.size();
        const uint32_t want = id + 1;
        size_t i = home(mix(at(id).key));
        while ((slots_[i] & ID_MASK) != want) i = i + 1 == cap ? 0 : i + 1;
        // Backward shift: pull later members of the probe run into the hole.
        for (size_t j = i;;) {
            j = j + 1 == cap ? 0 : j + 1;
            const uint32_t s = slots_[j];
            if (!s) break;
            const size_t k = home(mix(at((s & ID_MASK) - 1).key));
            const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
            if (stays) continue;
            slots_[i] = s;
            i = j;
        }
        slots_[i] = 0;
        --size_;
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

   private:
    static constexpr int CHUNK_BITS = 14;  // 16K nodes a chunk
    static constexpr uint32_t CHUNK = 1u << CHUNK_BITS;

    static uint64_t mix(uint64_t k) {
        k ^= k >> 33;
        k *= 0xFF51AFD7ED558CCDULL;
        k ^= k >> 33;
        return k;
    }
    static uint32_t tag_of(uint64_t h) { return static_cast<uint32_t>(h & 31); }
    size_t home(uint64_t h) const {
        return static_cast<size_t>((static_cast<__uint128_t>(h) * slots_.size()) >> 64);
    }

    uint32_t allocate() {
        uint32_t id;
        if (!free_.empty()) {
            id = free_.back();
            free_.pop_back();
        } else {
            if (top_ >= MAX_NODES) throw std::length_error("the native index holds at most 2**27 - 2 blocks");
            id = top_++;
            if ((id >> CHUNK_BITS) >= chunks_.size()) chunks_.emplace_back(new Node[CHUNK]);
            if ((id >> 6) >= used_.size()) used_.push_back(0);
        }
        used_[id >> 6] |= uint64_t{1} << (id & 63);
        return id;
    }

    // Rebuilt from the nodes in id order (sequential reads, not the old table's order).
    void rehash(size_t cap) {
        std::vector<uint32_t>(cap, 0).swap(slots_);
        for_each([&](uint32_t id, Node& n) {
            const uint64_t h = mix(n.key);
            size_t i = home(h);
            while (slots_[i]) i = i + 1 == cap ? 0 : i + 1;
            slots_[i] = (tag_of(h) << ID_BITS) | (id + 1);
        });
    }

    std::vector<uint32_t> slots_;
    std::vector<std::unique_ptr<Node[]>> chunks_;
    std::vector<uint32_t> free_;
    std::vector<uint64_t> used_;  // bit per id: in use
    uint32_t top_ = 0;            // ids below it were handed out once
    size_t size_ = 0;
};

}  // namespace cr
