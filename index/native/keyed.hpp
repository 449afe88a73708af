// The slot hash of every native hash table: keyed by secrets drawn once per process, so
// a publisher that picks the keys (engine hashes are the publisher's own; a 32-byte name's
// key is its head xor a public mix of its tail, so any key can be had) cannot pick keys
// that share a probe run. Until session 16 the tables used public bijections (MurmurHash3's
// finalizer, a golden-ratio multiply, std::hash's identity) and 40K crafted stores into
// one worker's table took 2.5 s instead of 9 ms, under the core's mutex.
//
// The mix is wyhash's 64-bit one (two 64x64->128 multiplies) with the secrets in place of
// its constants: no fewer instructions than the finalizer it replaces (callgrind).
#pragma once

#include <cstdint>
#include <cstdio>
#include <random>
#include <utility>

namespace cr {

struct HashKeys {
    uint64_t k[4];
};

inline HashKeys draw_hash_keys() {
    HashKeys s{};
    std::random_device rd;  // the OS's getrandom
    for (uint64_t& x : s.k) x = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    s.k[1] |= 1;  // an odd multiplier
    return s;
}

inline const HashKeys kHashKeys = draw_hash_keys();

inline uint64_t mum_fold(uint64_t a, uint64_t b) {
    const __uint128_t p = static_cast<__uint128_t>(a) * b;
    return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}

// A keyed 64-bit mix of ``x``: every output bit depends on every key bit.
inline uint64_t keyed_mix(uint64_t x) {
    const uint64_t* k = kHashKeys.k;
    return mum_fold(mum_fold(x ^ k[0], k[1]) ^ k[2], x ^ k[3]);
}

// For std::unordered_map keyed by a u64 a publisher chose.
struct KeyedHash {
    size_t operator()(uint64_t x) const { return static_cast<size_t>(keyed_mix(x)); }
    size_t operator()(const std::pair<uint64_t, int>& p) const {
        return static_cast<size_t>(keyed_mix(p.first ^ (static_cast<uint64_t>(p.second) << 58)));
    }
};

}  // namespace cr
