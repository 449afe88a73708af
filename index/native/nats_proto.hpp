// The NATS client protocol's server side, as a bounded incremental parser: what the
// native event reader (nats_reader.hpp) reads off its socket. Facts from the protocol
// reference (docs.nats.io/reference/protocols/client): operation names are case
// insensitive; ``MSG <subject> <sid> [reply-to] <#bytes>\r\n<payload>\r\n``,
// ``HMSG <subject> <sid> [reply-to] <#header bytes> <#total bytes>\r\n<headers><payload>\r\n``
// with headers ``NATS/1.0[ status]\r\n(Key: Value\r\n)*\r\n``; ``INFO {json}``, ``PING``,
// ``PONG``, ``+OK``, ``-ERR '<text>'``.
//
// Every size is bounded. ``max_control`` is the server's max_control_line, which bounds
// the line a client sends (``PUB``): the ``MSG`` line the server forwards for it is longer
// by the sid and a letter (``HPUB`` -> ``HMSG``), so lines up to ``max_control`` plus
// ``MSG_OVERHEAD`` are read as usual. Until session 16 the reader stopped at 4,096 and one
// publisher whose PUB line was 4,091-4,096 bytes (nats-server takes it) disconnected it
// and put every worker out of sync, 79 times in 5 s. A longer MSG line (a server with a
// larger max_control_line, a subject mapping that grew it) is still framed: its size is on
// the line, so its payload is skipped like an oversized one and its subject reported
// (only that worker is resynced); other lines (a cluster's long INFO) are read up to
// ``HARD_LINE``. A line with no end within ``HARD_LINE`` bytes is a protocol error (the
// connection is dropped, as nats-server does with a client's). A message over ``max_payload`` is skipped byte by byte, never
// buffered, and reported.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cr {

enum class FrameKind { NEED_MORE, INFO, MSG, OVERSIZED, PING, PONG, OK, ERR, BAD };

struct Frame {
    FrameKind kind = FrameKind::NEED_MORE;
    std::string_view subject, headers, payload;  // MSG (OVERSIZED: subject only)
    std::string_view text;                       // INFO's json, ERR's text, BAD's reason
};

// Parses one header block: false when it is not one. ``status`` is what follows
// ``NATS/1.0`` on the first line (empty for a plain message).
inline bool parse_headers(std::string_view block, std::string_view& status,
                          std::vector<std::pair<std::string_view, std::string_view>>& out) {
    out.clear();
    auto trim = [](std::string_view s) {
        while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
        while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
        return s;
    };
    size_t eol = block.find("\r\n");
    if (eol == std::string_view::npos) return false;
    std::string_view first = block.substr(0, eol);
    if (first.substr(0, 8) != "NATS/1.0") return false;
    status = trim(first.substr(8));
    size_t pos = eol + 2;
    while (pos < block.size()) {
        eol = block.find("\r\n", pos);
        if (eol == std::string_view::npos) return false;
        std::string_view line = block.substr(pos, eol - pos);
        pos = eol + 2;
        if (line.empty()) continue;  // the blank line that ends the block
        size_t colon = line.find(':');
        if (colon == std::string_view::npos || colon == 0) return false;
        out.emplace_back(trim(line.substr(0, colon)), trim(line.substr(colon + 1)));
    }
    return true;
}

class NatsParser {
   public:
    // " <sid>" (the reader's sid is 1; 24 covers any u64) and HPUB's one more letter,
    // rounded up.
    static constexpr size_t MSG_OVERHEAD = 64;
    // The longest line looked for an end in; longer is garbage, not a NATS server.
    static constexpr size_t HARD_LINE = 64u << 10;

    NatsParser(size_t max_control, size_t max_payload)
        : max_line_(max_control + MSG_OVERHEAD),
          hard_line_(std::max(HARD_LINE, max_line_)),
          max_payload_(max_payload) {}

    // Room for the socket's next read (at least ``want`` bytes).
    char* space(size_t want) {
        compact();
        if (buf_.size() - end_ < want) buf_.resize(end_ + want);
        return buf_.data() + end_;
    }
    void wrote(size_t n) { end_ += n; }
    void reset() { pos_ = end_ = 0, skip_ = 0, scanned_ = 0; }

    // The next frame in what was read so far; its views live until the next call.
    Frame next() {
        Frame f;
        if (skip_) {
            const size_t n = std::min(skip_, end_ - pos_);
            pos_ += n, skip_ -= n;
            if (skip_) return f;
        }
        const char* base = buf_.data() + pos_;
        const size_t avail = end_ - pos_;
        // Resumes where the last look stopped: a line read in many pieces is scanned once.
        const size_t look = std::min(avail, hard_line_ + 2);
        const void* nl = scanned_ < look ? std::memchr(base + scanned_, '\n', look - scanned_)
                                         : nullptr;
        if (!nl) {
            if (avail > hard_line_ + 1) return bad(f, "maximum control line exceeded");
            scanned_ = look;
            return f;
        }
        scanned_ = 0;
        const size_t line_len = static_cast<const char*>(nl) - base + 1;
        std::string_view line(base, line_len);
        if (line.size() < 2 || line[line.size() - 2] != '\r') return bad(f, "line without CRLF");
        line.remove_suffix(2);
        std::vector<std::string_view> args;
        split(line, args);
        if (args.empty()) return bad(f, "empty control line");
        const std::string op = upper(args[0]);
        if (op == "MSG" || op == "HMSG")
            return message(f, op == "HMSG", args, line_len, base, line_len > max_line_ + 2);
        pos_ += line_len;
        if (op == "PING") f.kind = FrameKind::PING;
        else if (op == "PONG") f.kind = FrameKind::PONG;
        else if (op == "+OK") f.kind = FrameKind::OK;
        else if (op == "INFO" || op == "-ERR") {
            f.kind = op == "INFO" ? FrameKind::INFO : FrameKind::ERR;
            std::string_view rest = line.substr(std::min(line.size(), op.size()));
            while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
            if (f.kind == FrameKind::ERR && rest.size() >= 2 && rest.front() == '\'' &&
                rest.back() == '\'')
                rest = rest.substr(1, rest.size() - 2);
            f.text = rest;
        } else {
            return bad(f, "unknown protocol operation");
        }
        return f;
    }

   private:
    Frame& bad(Frame& f, const char* why) {
        f.kind = FrameKind::BAD;
        f.text = why;
        return f;
    }

    static std::string upper(std::string_view s) {
        std::string out(s);
        for (char& c : out)
            if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
        return out;
    }

    static void split(std::string_view line, std::vector<std::string_view>& out) {
        size_t i = 0;
        while (i < line.size() && out.size() < 8) {
            while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
            size_t j = i;
            while (j < line.size() && line[j] != ' ' && line[j] != '\t') ++j;
            if (j > i) out.push_back(line.substr(i, j - i));
            i = j;
        }
    }

    static bool size_of(std::string_view s, size_t& out) {
        if (s.empty() || s.size() > 12) return false;
        size_t v = 0;
        for (char c : s) {
            if (c < '0' || c > '9') return false;
            v = v * 10 + static_cast<size_t>(c - '0');
        }
        out = v;
        return true;
    }

    // ``skip_whole``: the line is past ``max_line_``: the message is reported as oversized.
    Frame& message(Frame& f, bool with_headers, const std::vector<std::string_view>& args,
                   size_t line_len, const char* base, bool skip_whole) {
        // MSG subj sid [reply] n | HMSG subj sid [reply] hn n
        const size_t fixed = with_headers ? 5 : 4;
        if (args.size() != fixed && args.size() != fixed + 1)
            return bad(f, "malformed MSG line");
        size_t total = 0, hdr = 0;
        if (!size_of(args.back(), total)) return bad(f, "malformed MSG size");
        if (with_headers && (!size_of(args[args.size() - 2], hdr) || hdr > total))
            return bad(f, "malformed HMSG header size");
        if (total > max_payload_ || skip_whole) {
            // A copy of the subject: the bytes it points at are skipped next.
            subject_.assign(args[1]);
            pos_ += line_len;
            skip_ = total + 2;
            f.kind = FrameKind::OVERSIZED;
            f.subject = subject_;
            return f;
        }
        if (end_ - pos_ < line_len + total + 2) return f;  // the rest is still on the way
        const char* body = base + line_len;
        if (body[total] != '\r' || body[total + 1] != '\n')
            return bad(f, "message without its CRLF");
        f.kind = FrameKind::MSG;
        f.subject = args[1];
        f.headers = std::string_view(body, hdr);
        f.payload = std::string_view(body + hdr, total - hdr);
        pos_ += line_len + total + 2;
        return f;
    }

    void compact() {
        if (pos_ == 0) return;
        std::memmove(buf_.data(), buf_.data() + pos_, end_ - pos_);
        end_ -= pos_, pos_ = 0;
        // Give a buffer grown for one large message back once it is consumed.
        if (buf_.size() > (4u << 20) && end_ < (1u << 20)) buf_.resize(1u << 20);
    }

    size_t max_line_, hard_line_, max_payload_;
    std::vector<char> buf_;
    size_t pos_ = 0, end_ = 0, skip_ = 0;
    size_t scanned_ = 0;  // bytes from pos_ looked through for a line's end already
    std::string subject_;
};

}  // namespace cr
