// libFuzzer target: the byte stream a NATS server sends the native reader, fed to its
// parser in pieces whose sizes the input picks (a frame split anywhere), every MSG's
// header block parsed and its Kv-* headers read as the reader does, and the seq rules
// run on what they say (a worker's seq state across the stream's messages).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../index/native/kv_headers.hpp"
#include "../index/native/nats_proto.hpp"
#include "../index/native/seq.hpp"

using namespace cr;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 2) return 0;
    // a small max_control and max_payload, so the long-line and oversized paths run
    const size_t max_control = 256 + (data[0] & 0x3f);
    const size_t piece = 1 + data[1];
    NatsParser parser(max_control, 512);
    SeqRules rules(1000, 4);
    SeqState state;
    std::vector<std::pair<std::string_view, std::string_view>> kv;
    size_t at = 2;
    while (at < size) {
        const size_t n = std::min(piece, size - at);
        std::memcpy(parser.space(n), data + at, n);
        parser.wrote(n);
        at += n;
        for (Frame f = parser.next(); f.kind != FrameKind::NEED_MORE; f = parser.next()) {
            if (f.kind == FrameKind::BAD) return 0;  // the reader drops the connection
            if (f.kind != FrameKind::MSG || f.headers.empty()) continue;
            std::string_view status;
            if (!parse_headers(f.headers, status, kv)) continue;
            KvHeaders h;
            if (!read_kv_headers(kv, h) || !h.has_seq) continue;
            SeqDecision d = rules.decide(state, h.rank, h.seq, h.epoch);
            if (d.apply) SeqRules::commit(state, h.rank, h.seq);
            if (f.payload.size() == 1) SeqRules::load_dump(state, h.rank, h.seq, h.epoch);
            if (f.payload.size() == 2) SeqRules::malformed(state, h.rank, h.seq, h.epoch);
            if (f.payload.size() == 3) SeqRules::forget_unconfirmed(state);
        }
    }
    return 0;
}
