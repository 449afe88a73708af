// Open-addressing hash map from a 64-bit key to a small value: one array of
// {key, value} slots, linear probing, backward-shift deletion (no tombstones).
//
// Why not std::unordered_map: it spends a heap node (~32 B of overhead plus malloc
// rounding) per entry; the index keeps millions of entries, so per-entry bytes are the
// memory bound. Capacity grows by 1.5x at a load of 0.8 (mean load ~0.65), and the slot
// is picked by multiply-shift over a mixed key, so any capacity works, not only powers of
// two. One key value marks an empty slot; a real key equal to it lives in a side slot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "keyed.hpp"

namespace cr {

template <class V>
class FlatMap {
   public:
    static constexpr uint64_t EMPTY = 0x8F3A71C59D2E4B61ULL;

    // A value of alignment 1 (a packed struct) gets a packed slot: no padding after it.
    struct AlignedSlot {
        uint64_t key;
        V value;
    };
    struct __attribute__((packed)) PackedSlot {
        uint64_t key;
        V value;
    };
    using Slot = std::conditional_t<alignof(V) == 1, PackedSlot, AlignedSlot>;

    size_t size() const { return size_ + (has_empty_key_ ? 1 : 0); }
    size_t capacity() const { return slots_.size(); }
    size_t bytes() const { return slots_.capacity() * sizeof(Slot); }

    V* find(uint64_t key) {
        if (key == EMPTY) return has_empty_key_ ? &empty_key_value_ : nullptr;
        if (slots_.empty()) return nullptr;
        size_t i = home(key);
        const size_t cap = slots_.size();
        for (;;) {
            Slot& s = slots_[i];
            if (s.key == key) return &s.value;
            if (s.key == EMPTY) return nullptr;
            if (++i == cap) i = 0;
        }
    }

    const V* find(uint64_t key) const { return const_cast<FlatMap*>(this)->find(key); }

    // The value for ``key``, default-constructed when new (``inserted`` says which).
    // Pointers into the map are invalidated when it grows.
    V& get_or_insert(uint64_t key, bool& inserted) {
        if (key == EMPTY) {
            inserted = !has_empty_key_;
            if (inserted) empty_key_value_ = V{};
            has_empty_key_ = true;
            return empty_key_value_;
        }
        if ((size_ + 1) * 5 > slots_.size() * 4) grow();
        size_t i = home(key);
        const size_t cap = slots_.size();
        for (;;) {
            Slot& s = slots_[i];
            if (s.key == key) {
                inserted = false;
                return s.value;
            }
            if (s.key == EMPTY) {
                s.key = key;
                s.value = V{};
                ++size_;
                inserted = true;
                return s.value;
            }
            if (++i == cap) i = 0;
        }
    }

    bool erase(uint64_t key) {
        if (key == EMPTY) {
            bool had = has_empty_key_;
            has_empty_key_ = false;
            return had;
        }
        if (slots_.empty()) return false;
        const size_t cap = slots_.size();
        size_t i = home(key);
        for (;;) {
            if (slots_[i].key == key) break;
            if (slots_[i].key == EMPTY) return false;
            if (++i == cap) i = 0;
        }
        // Backward shift: pull later members of the probe run into the hole.
        size_t j = i;
        for (;;) {
            if (++j == cap) j = 0;
            if (slots_[j].key == EMPTY) break;
            size_t k = home(slots_[j].key);
            bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
            if (stays) continue;
            slots_[i] = slots_[j];
            i = j;
        }
        slots_[i].key = EMPTY;
        --size_;
        return true;
    }

    void clear() {
        std::vector<Slot>().swap(slots_);
        size_ = 0;
        has_empty_key_ = false;
    }

    // Empty, keeping the slots (a set refilled to the same size right away).
    void clear_keep() {
        for (Slot& s : slots_) s.key = EMPTY;
        size_ = 0;
        has_empty_key_ = false;
    }

    template <class F>
    void for_each(F&& f) {
        for (Slot& s : slots_)
            if (s.key != EMPTY) f(s.key, s.value);
        if (has_empty_key_) f(EMPTY, empty_key_value_);
    }

    void reserve(size_t n) {
        if (n * 5 > slots_.size() * 4) rehash(n * 5 / 4 + 16);
    }

   private:
    size_t home(uint64_t key) const {
        const uint64_t h = keyed_mix(key);  // keyed.hpp: no key a publisher picks collides by design
        return static_cast<size_t>((static_cast<__uint128_t>(h) * slots_.size()) >> 64);
    }

    void grow() { rehash(slots_.size() < 16 ? 16 : slots_.size() + slots_.size() / 2); }

    void rehash(size_t cap) {
        std::vector<Slot> old;
        old.swap(slots_);
        slots_.assign(cap, Slot{EMPTY, V{}});
        slots_.shrink_to_fit();
        for (Slot& s : old) {
            if (s.key == EMPTY) continue;
            size_t i = home(s.key);
            while (slots_[i].key != EMPTY)
                if (++i == cap) i = 0;
            slots_[i] = std::move(s);
        }
    }

    std::vector<Slot> slots_;
    size_t size_ = 0;
    bool has_empty_key_ = false;
    V empty_key_value_{};
};

}  // namespace cr
