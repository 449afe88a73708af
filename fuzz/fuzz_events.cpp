// libFuzzer target: one KV-event batch (msgpack) as a publisher sends it, through the
// native decoder and, when it decodes, the applier and the index (a small per-worker
// quota and index bound, so the cut and the eviction run too), then a match. The first
// input byte picks the worker slot and the router's block size; the rest is the payload.
#include <cstddef>
#include <cstdint>

#include "../index/native/events.hpp"

using namespace cr;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const int slot = data[0] & 3;
    const int64_t block_size = 1 + ((data[0] >> 2) & 3);  // 1..4: the seeds' sizes divide
    static const TierTable tiers = {{"GPU", GPU}, {"CPU", CPU}, {"CPU_PINNED", CPU},
                                    {"DISK", DISK}, {"REMOTE", SHARED}};
    static EventDecoder decoder(tiers);
    // Fresh state per input: a crash reproduces from its input alone.
    PrefixCore index(64, 4);
    EventApplier applier(index, block_size, (data[0] >> 4) & 1, 0x1234);
    for (int s = 0; s < 4; ++s) index.add_slot(s);
    ParsedBatch parsed;
    try {
        decoder.parse(data + 1, size - 1, parsed);
    } catch (const DecodeError&) {
        return 0;
    }
    ApplyResult res;
    applier.apply(slot, parsed.events, 48, res);
    applier.apply((slot + 1) & 3, parsed.events, -1, res);  // a second worker, no quota
    // the same events again: re-stores, removals of what is held, clears of a full worker
    applier.apply(slot, parsed.events, 48, res);
    std::vector<uint64_t> probe;
    for (const PEvent& ev : parsed.events)
        for (uint64_t h : ev.hashes) probe.push_back(h);
    Depths d;
    index.depths(probe.data(), probe.size(), false, 0, d);
    TierDepths t;
    index.split_tiers(probe.data(), probe.size(), false, d, t);
    return 0;
}
