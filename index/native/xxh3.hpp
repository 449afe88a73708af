// XXH3-64 (seeded), written from the published algorithm description so the router's
// block hashes stay bit-identical to the Python `xxhash.xxh3_64_intdigest` the pure
// Python path uses (tests/test_native.py checks it with hypothesis).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace cr {

namespace xxh3_detail {

constexpr uint64_t P32_1 = 0x9E3779B1ULL, P32_2 = 0x85EBCA77ULL, P32_3 = 0xC2B2AE3DULL;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t P64_3 = 0x165667B19E3779F9ULL, P64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t P64_5 = 0x27D4EB2F165667C5ULL;
constexpr uint64_t PMX_1 = 0x165667919E3779F9ULL, PMX_2 = 0x9FB21C651E98DF25ULL;
constexpr size_t SECRET_SIZE = 192;

// The algorithm's default 192-byte secret (a constant of XXH3 itself).
alignas(64) constexpr uint8_t kSecret[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

inline uint64_t rd64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

inline uint32_t rd32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

inline void wr64(uint8_t* p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    std::memcpy(p, &v, 8);
}

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t fold(uint64_t a, uint64_t b) {
    __uint128_t m = static_cast<__uint128_t>(a) * b;
    return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
}

inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PMX_1;
    return h ^ (h >> 32);
}

inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl(h, 49) ^ rotl(h, 24);
    h *= PMX_2;
    h ^= (h >> 35) + len;
    h *= PMX_2;
    return h ^ (h >> 28);
}

inline uint64_t mix16(const uint8_t* in, const uint8_t* sec, uint64_t seed) {
    return fold(rd64(in) ^ (rd64(sec) + seed), rd64(in + 8) ^ (rd64(sec + 8) - seed));
}

inline uint64_t len_0to16(const uint8_t* in, size_t len, uint64_t seed) {
    const uint8_t* s = kSecret;
    if (len > 8) {
        uint64_t lo = rd64(in) ^ ((rd64(s + 24) ^ rd64(s + 32)) + seed);
        uint64_t hi = rd64(in + len - 8) ^ ((rd64(s + 40) ^ rd64(s + 48)) - seed);
        return avalanche(len + __builtin_bswap64(lo) + hi + fold(lo, hi));
    }
    if (len >= 4) {
        seed ^= static_cast<uint64_t>(__builtin_bswap32(static_cast<uint32_t>(seed))) << 32;
        uint64_t v = rd32(in + len - 4) + (static_cast<uint64_t>(rd32(in)) << 32);
        return rrmxmx(v ^ ((rd64(s + 8) ^ rd64(s + 16)) - seed), len);
    }
    if (len) {
        uint32_t c = (static_cast<uint32_t>(in[0]) << 16) |
                     (static_cast<uint32_t>(in[len >> 1]) << 24) | in[len - 1] |
                     (static_cast<uint32_t>(len) << 8);
        return xxh64_avalanche(c ^ ((rd32(s) ^ rd32(s + 4)) + seed));
    }
    return xxh64_avalanche(seed ^ (rd64(s + 56) ^ rd64(s + 64)));
}

inline uint64_t len_17to128(const uint8_t* in, size_t len, uint64_t seed) {
    const uint8_t* s = kSecret;
    uint64_t acc = len * P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix16(in + 48, s + 96, seed);
                acc += mix16(in + len - 64, s + 112, seed);
            }
            acc += mix16(in + 32, s + 64, seed);
            acc += mix16(in + len - 48, s + 80, seed);
        }
        acc += mix16(in + 16, s + 32, seed);
        acc += mix16(in + len - 32, s + 48, seed);
    }
    acc += mix16(in, s, seed);
    acc += mix16(in + len - 16, s + 16, seed);
    return avalanche(acc);
}

inline uint64_t len_129to240(const uint8_t* in, size_t len, uint64_t seed) {
    const uint8_t* s = kSecret;
    uint64_t acc = len * P64_1;
    const size_t rounds = len / 16;
    for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, s + 16 * i, seed);
    acc = avalanche(acc);
    for (size_t i = 8; i < rounds; ++i) acc += mix16(in + 16 * i, s + 16 * (i - 8) + 3, seed);
    acc += mix16(in + len - 16, s + 136 - 17, seed);
    return avalanche(acc);
}

inline void accumulate512(uint64_t* acc, const uint8_t* in, const uint8_t* sec) {
    for (int i = 0; i < 8; ++i) {
        uint64_t v = rd64(in + 8 * i);
        uint64_t k = v ^ rd64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

inline void scramble(uint64_t* acc, const uint8_t* sec) {
    for (int i = 0; i < 8; ++i) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(sec + 8 * i);
        acc[i] = a * P32_1;
    }
}

inline uint64_t hash_long(const uint8_t* in, size_t len, uint64_t seed) {
    alignas(64) uint8_t sec[SECRET_SIZE];
    for (size_t i = 0; i < SECRET_SIZE; i += 16) {
        wr64(sec + i, rd64(kSecret + i) + seed);
        wr64(sec + i + 8, rd64(kSecret + i + 8) - seed);
    }
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    constexpr size_t stripes_per_block = (SECRET_SIZE - 64) / 8;
    constexpr size_t block_len = 64 * stripes_per_block;
    const size_t blocks = (len - 1) / block_len;
    for (size_t b = 0; b < blocks; ++b) {
        for (size_t st = 0; st < stripes_per_block; ++st)
            accumulate512(acc, in + b * block_len + st * 64, sec + st * 8);
        scramble(acc, sec + SECRET_SIZE - 64);
    }
    const size_t stripes = ((len - 1) - block_len * blocks) / 64;
    for (size_t st = 0; st < stripes; ++st)
        accumulate512(acc, in + blocks * block_len + st * 64, sec + st * 8);
    accumulate512(acc, in + len - 64, sec + SECRET_SIZE - 64 - 7);
    uint64_t r = len * P64_1;
    for (int i = 0; i < 4; ++i)
        r += fold(acc[2 * i] ^ rd64(sec + 11 + 16 * i), acc[2 * i + 1] ^ rd64(sec + 11 + 16 * i + 8));
    return avalanche(r);
}

}  // namespace xxh3_detail

inline uint64_t xxh3_64(const void* data, size_t len, uint64_t seed) {
    const auto* in = static_cast<const uint8_t*>(data);
    if (len <= 16) return xxh3_detail::len_0to16(in, len, seed);
    if (len <= 128) return xxh3_detail::len_17to128(in, len, seed);
    if (len <= 240) return xxh3_detail::len_129to240(in, len, seed);
    return xxh3_detail::hash_long(in, len, seed);
}

}  // namespace cr
