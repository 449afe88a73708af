// A small msgpack reader: just what KV-event batches use (nil, bool, ints, floats,
// str, bin, array, map; ext is skipped). Every read is bounds-checked; a truncated or
// malformed payload throws ``DecodeError`` instead of reading past the buffer.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string_view>

namespace cr {

struct DecodeError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

enum class Kind { Nil, Bool, Int, UInt, Float, Str, Bin, Array, Map, Ext };

struct Value {
    Kind kind;
    union {
        bool b;
        int64_t i;
        uint64_t u;
        double f;
        uint32_t n;  // array / map length
    };
    std::string_view bytes;  // str / bin / ext payload
};

// A big-endian unsigned int of ``T``'s width at ``p`` (msgpack's order), in one load.
template <class T>
inline T load_be(const uint8_t* p) {
    T x;
    std::memcpy(&x, p, sizeof x);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return x;
#else
    if constexpr (sizeof x == 4) return __builtin_bswap32(x);
    else return __builtin_bswap64(x);
#endif
}

class Reader {
   public:
    Reader(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}

    bool done() const { return p_ == end_; }

    // Up to ``n`` unsigned ints at the cursor into ``out``: how many were read. The first
    // value that is not one stops it, with the cursor at that value. The fast path for
    // token and hash arrays: as many values as the bytes left would hold at 9 bytes each
    // (the longest uint) are read with no bounds check, a value's big-endian bytes in
    // one load. Callgrind over bench/scale.py's batches (16 blocks of 16 tokens):
    // 39 -> 19 instructions a value, a batch's decode 1,113 -> 630 a block.
    uint32_t uints(uint64_t* out, uint32_t n) {
        uint32_t i = 0;
        const uint8_t* p = p_;
        for (size_t room; i < n && (room = static_cast<size_t>(end_ - p) / 9);) {
            // ``room`` values fit in what is left whatever their widths
            const uint32_t stop = n - i < room ? n : i + static_cast<uint32_t>(room);
            for (; i < stop; ++i) {
                const uint8_t c = *p;
                if (c <= 0x7f) {
                    out[i] = c;
                    p += 1;
                } else if (c == 0xcd) {
                    out[i] = static_cast<uint64_t>(p[1]) << 8 | p[2];
                    p += 3;
                } else if (c == 0xce) {
                    out[i] = load_be<uint32_t>(p + 1);
                    p += 5;
                } else if (c == 0xcc) {
                    out[i] = p[1];
                    p += 2;
                } else if (c == 0xcf) {
                    out[i] = load_be<uint64_t>(p + 1);
                    p += 9;
                } else {
                    p_ = p;
                    return i;
                }
            }
        }
        p_ = p;
        for (; i < n && next_uint(out[i]); ++i) {
        }
        return i;
    }

    // An unsigned int at the cursor is read into ``out`` (true); anything else leaves
    // the cursor where it was (false). The fast path for token and hash arrays.
    bool next_uint(uint64_t& out) {
        if (p_ >= end_) return false;
        const uint8_t c = *p_;
        if (c <= 0x7f) {
            out = c;
            ++p_;
            return true;
        }
        int n;
        switch (c) {
            case 0xcc: n = 1; break;
            case 0xcd: n = 2; break;
            case 0xce: n = 4; break;
            case 0xcf: n = 8; break;
            default: return false;
        }
        if (end_ - p_ < n + 1) return false;
        uint64_t x = 0;
        for (int i = 1; i <= n; ++i) x = (x << 8) | p_[i];
        p_ += n + 1;
        out = x;
        return true;
    }

    const uint8_t* pos() const { return p_; }
    void seek(const uint8_t* p) { p_ = p; }

    Value next() {
        const uint8_t c = byte();
        Value v{};
        if (c <= 0x7f) return int_(c);
        if (c >= 0xe0) return sint(static_cast<int8_t>(c));
        if ((c & 0xf0) == 0x80) return len(Kind::Map, c & 0x0f);
        if ((c & 0xf0) == 0x90) return len(Kind::Array, c & 0x0f);
        if ((c & 0xe0) == 0xa0) return str(Kind::Str, c & 0x1f);
        switch (c) {
            case 0xc0: v.kind = Kind::Nil; return v;
            case 0xc2: v.kind = Kind::Bool; v.b = false; return v;
            case 0xc3: v.kind = Kind::Bool; v.b = true; return v;
            case 0xc4: return str(Kind::Bin, be(1));
            case 0xc5: return str(Kind::Bin, be(2));
            case 0xc6: return str(Kind::Bin, be(4));
            case 0xc7: return ext(be(1));
            case 0xc8: return ext(be(2));
            case 0xc9: return ext(be(4));
            case 0xca: {
                uint32_t x = static_cast<uint32_t>(be(4));
                float f;
                std::memcpy(&f, &x, 4);
                v.kind = Kind::Float;
                v.f = f;
                return v;
            }
            case 0xcb: {
                uint64_t x = be(8);
                v.kind = Kind::Float;
                std::memcpy(&v.f, &x, 8);
                return v;
            }
            case 0xcc: return int_(be(1));
            case 0xcd: return int_(be(2));
            case 0xce: return int_(be(4));
            case 0xcf: return int_(be(8));
            case 0xd0: return sint(static_cast<int8_t>(be(1)));
            case 0xd1: return sint(static_cast<int16_t>(be(2)));
            case 0xd2: return sint(static_cast<int32_t>(be(4)));
            case 0xd3: return sint(static_cast<int64_t>(be(8)));
            case 0xd4: return ext(1);
            case 0xd5: return ext(2);
            case 0xd6: return ext(4);
            case 0xd7: return ext(8);
            case 0xd8: return ext(16);
            case 0xd9: return str(Kind::Str, be(1));
            case 0xda: return str(Kind::Str, be(2));
            case 0xdb: return str(Kind::Str, be(4));
            case 0xdc: return len(Kind::Array, be(2));
            case 0xdd: return len(Kind::Array, be(4));
            case 0xde: return len(Kind::Map, be(2));
            case 0xdf: return len(Kind::Map, be(4));
            default: throw DecodeError("invalid msgpack type byte");
        }
    }

    // Skip one whole value (containers included), bounded by an explicit stack count.
    void skip() {
        uint64_t todo = 1;
        while (todo) {
            --todo;
            Value v = next();
            if (v.kind == Kind::Array) todo += v.n;
            if (v.kind == Kind::Map) todo += 2ULL * v.n;
            if (todo > static_cast<uint64_t>(end_ - p_) + 1) throw DecodeError("truncated");
        }
    }

   private:
    uint8_t byte() {
        if (p_ >= end_) throw DecodeError("truncated");
        return *p_++;
    }
    uint64_t be(int n) {
        if (end_ - p_ < n) throw DecodeError("truncated");
        uint64_t x = 0;
        for (int i = 0; i < n; ++i) x = (x << 8) | p_[i];
        p_ += n;
        return x;
    }
    Value int_(uint64_t u) {
        Value v{};
        v.kind = Kind::UInt;
        v.u = u;
        return v;
    }
    Value sint(int64_t i) {
        Value v{};
        if (i >= 0) return int_(static_cast<uint64_t>(i));
        v.kind = Kind::Int;
        v.i = i;
        return v;
    }
    Value len(Kind k, uint64_t n) {
        // Each element takes at least one byte: a length past the buffer is garbage.
        if (n > static_cast<uint64_t>(end_ - p_) * (k == Kind::Map ? 1 : 1)) {
            throw DecodeError("container longer than the payload");
        }
        Value v{};
        v.kind = k;
        v.n = static_cast<uint32_t>(n);
        return v;
    }
    Value str(Kind k, uint64_t n) {
        if (static_cast<uint64_t>(end_ - p_) < n) throw DecodeError("truncated");
        Value v{};
        v.kind = k;
        v.bytes = std::string_view(reinterpret_cast<const char*>(p_), n);
        p_ += n;
        return v;
    }
    // An ext value is opaque, but msgpack-python (index/codec.py's decoder) refuses the
    // reserved types 0x80-0xfe (its ExtType takes 0-127) and decodes type -1, msgpack's
    // timestamp, refusing a malformed one: refused here the same way (before session 16
    // they were skipped here, so the two decoders disagreed on such batches).
    Value ext(uint64_t n) {
        const uint8_t type = byte();
        Value v = str(Kind::Ext, n);
        if (type >= 0x80 && type != 0xff) throw DecodeError("reserved ext type");
        if (type == 0xff) {
            const auto* d = reinterpret_cast<const uint8_t*>(v.bytes.data());
            uint64_t ns = 0;
            if (n == 8) ns = load_be<uint64_t>(d) >> 34;
            else if (n == 12) ns = load_be<uint32_t>(d);
            else if (n != 4) throw DecodeError("invalid timestamp");
            if (ns > 999999999) throw DecodeError("invalid timestamp");
        }
        return v;
    }

    const uint8_t* p_;
    const uint8_t* end_;
};

}  // namespace cr
