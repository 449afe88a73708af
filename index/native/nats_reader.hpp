// A core-NATS subscriber on its own thread and socket: connect (timed out), CONNECT with
// no auth, user/password or token, SUB one subject, then read and frame messages
// (nats_proto.hpp) and hand them to a handler on this thread, no GIL anywhere. It
// answers the server's PING and sends its own every ``ping_interval_ms``; a PONG missing
// for two intervals, a -ERR, a protocol error or a closed socket ends the session
// (``on_lost``) and it connects again with backoff. TLS and nkeys are not spoken here:
// the router keeps nats-py for those (router/native_events.py).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "nats_proto.hpp"

namespace cr {

struct NatsOptions {
    std::vector<std::pair<std::string, int>> servers;  // tried in turn
    std::string subject;                               // one SUB
    std::string user, password, token, name;
    int connect_timeout_ms = 2000;
    int ping_interval_ms = 2000;
    int max_backoff_ms = 5000;
    size_t max_control = 4096;  // nats-server's own default max_control_line
    size_t max_payload = 8u << 20;
};

class NatsHandler {
   public:
    virtual ~NatsHandler() = default;
    virtual void on_up() = 0;                          // subscribed (PONG after the SUB)
    virtual void on_lost(const std::string& why) = 0;  // a session that was up ended
    virtual void on_fail(const std::string& why) = 0;  // a connection attempt failed
    virtual void on_message(std::string_view subject, std::string_view headers,
                            std::string_view payload) = 0;
    virtual void on_oversized(std::string_view subject) = 0;
};

inline std::string json_string(std::string_view s) {
    std::string out = "\"";
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c < 0x20) {
            static const char hex[] = "0123456789abcdef";
            out += "\\u00";
            out += hex[c >> 4];
            out += hex[c & 15];
        } else {
            out += static_cast<char>(c);
        }
    }
    return out + "\"";
}

class NatsReader {
   public:
    NatsReader(NatsOptions opts, NatsHandler& handler)
        : opts_(std::move(opts)), handler_(handler),
          parser_(opts_.max_control, opts_.max_payload) {}
    ~NatsReader() { stop(); }

    void start() { thread_ = std::thread([this] { run(); }); }

    void stop() {
        stopping_ = true;
        if (thread_.joinable()) thread_.join();
    }

    std::atomic<int64_t> sessions{0}, bytes_read{0};

   private:
    using Clock = std::chrono::steady_clock;

    void run() {
        int backoff = 50;
        size_t server = 0;
        while (!stopping_) {
            const auto& [host, port] = opts_.servers[server % opts_.servers.size()];
            ++server;
            std::string why;
            bool was_up = false;
            int fd = dial(host, port, why);
            if (fd >= 0) {
                try {
                    was_up = session(fd, why);
                } catch (const std::exception& e) {
                    // nothing may end this thread (an uncaught exception ends the process):
                    // what threw ends the session, which reconnects as after a loss
                    why = std::string("internal error: ") + e.what();
                    was_up = up_;
                }
                ::close(fd);
            }
            if (stopping_) return;
            try {
                if (was_up) handler_.on_lost(why);
                else handler_.on_fail(why);
            } catch (const std::exception&) {  // out of memory for the news: go on without it
            }
            if (was_up) backoff = 50;
            sleep_ms(backoff);
            backoff = std::min(backoff * 2, opts_.max_backoff_ms);
        }
    }

    void sleep_ms(int ms) {
        const auto until = Clock::now() + std::chrono::milliseconds(ms);
        while (!stopping_ && Clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }

    int dial(const std::string& host, int port, std::string& why) {
        addrinfo hints{}, *res = nullptr;
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        const std::string p = std::to_string(port);
        if (getaddrinfo(host.c_str(), p.c_str(), &hints, &res) != 0 || !res) {
            why = "cannot resolve " + host;
            return -1;
        }
        int fd = -1;
        for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
            fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
            if (fd < 0) continue;
            const int flags = fcntl(fd, F_GETFL, 0);
            fcntl(fd, F_SETFL, flags | O_NONBLOCK);
            int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
            if (rc != 0 && errno == EINPROGRESS) {
                pollfd pfd{fd, POLLOUT, 0};
                int err = 0;
                socklen_t len = sizeof err;
                rc = ::poll(&pfd, 1, opts_.connect_timeout_ms) == 1 &&
                             getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0
                         ? 0
                         : -1;
            }
            if (rc != 0) {
                ::close(fd);
                fd = -1;
            }
        }
        freeaddrinfo(res);
        if (fd < 0) {
            why = "cannot connect to " + host + ":" + p;
            return -1;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return fd;
    }

    bool send_all(int fd, const std::string& s) {
        size_t off = 0;
        const auto deadline = Clock::now() + std::chrono::milliseconds(opts_.connect_timeout_ms);
        while (off < s.size()) {
            ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
            if (n > 0) {
                off += static_cast<size_t>(n);
                continue;
            }
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
            const auto left = deadline - Clock::now();
            if (left <= Clock::duration::zero()) return false;
            pollfd pfd{fd, POLLOUT, 0};
            ::poll(&pfd, 1,
                   static_cast<int>(
                       std::chrono::duration_cast<std::chrono::milliseconds>(left).count() + 1));
        }
        return true;
    }

    std::string connect_line() const {
        std::string c = "CONNECT {\"verbose\":false,\"pedantic\":false,\"tls_required\":false,";
        c += "\"lang\":\"cpp\",\"version\":\"cache-router\",\"protocol\":1,\"headers\":true,";
        c += "\"no_responders\":true,\"name\":" + json_string(opts_.name);
        if (!opts_.user.empty())
            c += ",\"user\":" + json_string(opts_.user) + ",\"pass\":" + json_string(opts_.password);
        if (!opts_.token.empty()) c += ",\"auth_token\":" + json_string(opts_.token);
        return c + "}\r\n";
    }

    // One connection: true when it got as far as subscribed (its end is a loss).
    bool session(int fd, std::string& why) {
        parser_.reset();
        ++sessions;
        bool& up = up_;
        up = false;
        bool greeted = false;
        auto handshake_until = Clock::now() + std::chrono::milliseconds(opts_.connect_timeout_ms);
        auto next_ping = Clock::now() + std::chrono::milliseconds(opts_.ping_interval_ms);
        int pings_out = 0;
        while (!stopping_) {
            const auto now = Clock::now();
            if (!up && now > handshake_until) {
                why = greeted ? "no PONG to the subscription" : "no INFO from the server";
                return false;
            }
            if (up && now >= next_ping) {
                if (pings_out >= 2) {
                    why = "stale connection (no PONG)";
                    return true;
                }
                if (!send_all(fd, "PING\r\n")) {
                    why = "write failed";
                    return true;
                }
                ++pings_out;
                next_ping = now + std::chrono::milliseconds(opts_.ping_interval_ms);
            }
            pollfd pfd{fd, POLLIN, 0};
            const int pr = ::poll(&pfd, 1, 50);
            if (pr < 0 && errno != EINTR) {
                why = "poll failed";
                return up;
            }
            if (pr <= 0) continue;
            char* dst = parser_.space(256 << 10);
            const ssize_t n = ::recv(fd, dst, 256 << 10, 0);
            if (n == 0) {
                why = "connection closed by the server";
                return up;
            }
            if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
                why = "read failed";
                return up;
            }
            parser_.wrote(static_cast<size_t>(n));
            bytes_read += n;
            for (Frame f = parser_.next(); f.kind != FrameKind::NEED_MORE; f = parser_.next()) {
                switch (f.kind) {
                    case FrameKind::MSG:
                        if (up) handler_.on_message(f.subject, f.headers, f.payload);
                        break;
                    case FrameKind::OVERSIZED:
                        if (up) handler_.on_oversized(f.subject);
                        break;
                    case FrameKind::PING:
                        if (!send_all(fd, "PONG\r\n")) {
                            why = "write failed";
                            return up;
                        }
                        break;
                    case FrameKind::PONG:
                        if (!up && greeted) {
                            up = true;
                            handler_.on_up();
                        }
                        pings_out = 0;
                        break;
                    case FrameKind::INFO:
                        if (!greeted) {
                            if (f.text.find("\"tls_required\":true") != std::string_view::npos) {
                                why = "the server requires TLS (the native reader has none)";
                                return false;
                            }
                            greeted = true;
                            if (!send_all(fd, connect_line() + "SUB " + opts_.subject +
                                                  " 1\r\nPING\r\n")) {
                                why = "write failed";
                                return false;
                            }
                        }
                        break;
                    case FrameKind::OK:
                        break;
                    case FrameKind::ERR:
                        why = "server error: " + std::string(f.text);
                        return up;
                    case FrameKind::BAD:
                        why = "protocol error: " + std::string(f.text);
                        return up;
                    case FrameKind::NEED_MORE:
                        break;
                }
            }
        }
        why = "closed";
        return up;
    }

    NatsOptions opts_;
    NatsHandler& handler_;
    NatsParser parser_;
    bool up_ = false;  // this session got as far as subscribed (reader thread only)
    std::thread thread_;
    std::atomic<bool> stopping_{false};
};

}  // namespace cr
