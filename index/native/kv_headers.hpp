// The headers of a live KV-event batch as the native reader reads them (Kv-Seq,
// Kv-Dp-Rank, Kv-Epoch), with router/events' rules: the last of a repeated key wins, as
// in Python's dict; a seq or rank that is no int in its range leaves the batch to Python.
// Bytes from any publisher: every number is parsed without overflow (UBSan found the
// 19-digit Kv-Seq that overflowed ``v * 10 + d`` before session 16).
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "seq.hpp"

namespace cr {

// A decimal int in [lo, hi] (an optional leading '-'); false for anything else.
inline bool int_in(std::string_view s, int64_t lo, int64_t hi, int64_t& out) {
    if (s.empty() || s.size() > 20) return false;
    const bool neg = s.front() == '-';
    if (neg) s.remove_prefix(1);
    if (s.empty()) return false;
    // magnitudes up to 2**63 (INT64_MIN's) in unsigned arithmetic: no overflow
    constexpr uint64_t LIMIT = uint64_t{1} << 63;
    uint64_t v = 0;
    for (char c : s) {
        if (c < '0' || c > '9') return false;
        const uint64_t d = static_cast<uint64_t>(c - '0');
        if (v > (LIMIT - d) / 10) return false;
        v = v * 10 + d;
    }
    int64_t x;
    if (neg) {
        x = v == LIMIT ? INT64_MIN : -static_cast<int64_t>(v);
    } else {
        if (v == LIMIT) return false;
        x = static_cast<int64_t>(v);
    }
    if (x < lo || x > hi) return false;
    out = x;
    return true;
}

struct KvHeaders {
    bool has_seq = false;
    int64_t seq = 0;
    int64_t rank = NO_RANK;
    Epoch epoch;
};

// False: a seq or rank the native path does not read (Python takes the batch).
inline bool read_kv_headers(const std::vector<std::pair<std::string_view, std::string_view>>& kv,
                            KvHeaders& out) {
    out = KvHeaders{};
    for (const auto& [k, v] : kv) {
        if (k == "Kv-Seq") {
            if (!int_in(v, 0, INT64_MAX, out.seq)) return false;
            out.has_seq = true;
        } else if (k == "Kv-Dp-Rank") {
            if (v.empty()) out.rank = NO_RANK;
            else if (!int_in(v, 0, (1 << 16) - 1, out.rank)) return false;
        } else if (k == "Kv-Epoch") {
            out.epoch.has = true;
            out.epoch.text.assign(v);
        }
    }
    return true;
}

}  // namespace cr
