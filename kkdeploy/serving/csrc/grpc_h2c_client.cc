// A unary gRPC client over cleartext HTTP/2 (h2c): `kkdeploy loadtest --client native`, the default where it builds.
//
// Why: Triton's perf_analyzer (a C++ load generator) cannot be installed on our machines, and grpcio's Python call
// costs 0.15-0.4 ms per request on the lent GPU host, more than the server spends on a batch-1 request. This client
// is driven from Python through ctypes (which releases the GIL for the call), one connection per client thread, one
// call at a time: it sends a request that Python serialized once, as perf_analyzer does, and hands back the response
// message and its header blocks. Python decodes the HPACK blocks (grpc-status, grpc-message) and checks the answer
// after its clock has stopped (kkdeploy/serving/native_client.py).
//
// What HTTP/2 it speaks (RFC 9113), and why that is enough for one unary call at a time:
// - the connection preface, then our SETTINGS: no server push, a 0-byte HPACK dynamic table (so every header block
//   the server sends decodes on its own, without state), the largest stream window and frame size; and a
//   WINDOW_UPDATE that opens the connection's window, replenished as answers arrive;
// - a request is one HEADERS frame (HPACK: static-table indices and literals, no Huffman) and DATA frames within
//   the server's frame size and flow-control windows (waiting for its WINDOW_UPDATEs when they run out);
// - while it waits it answers SETTINGS (ACK, applying the server's window and frame sizes) and PING, counts
//   WINDOW_UPDATE, gathers HEADERS and CONTINUATION into blocks and DATA into the message, until END_STREAM;
//   RST_STREAM and GOAWAY end the call with their error codes, and a broken connection is reopened by the next call;
// - before a request it reads what came while the connection sat idle, so a connection the server closed or left with
//   GOAWAY is replaced first, and a stream the server refused unseen is sent once more, on a fresh connection.
// Not spoken: TLS, streaming calls, compression (we send no grpc-accept-encoding, so the server does not compress),
// concurrent streams on one connection.

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

enum FrameType : uint8_t {
  kData = 0x0, kHeaders = 0x1, kPriority = 0x2, kRstStream = 0x3, kSettings = 0x4, kPushPromise = 0x5,
  kPing = 0x6, kGoAway = 0x7, kWindowUpdate = 0x8, kContinuation = 0x9,
};
constexpr uint8_t kEndStream = 0x1, kAck = 0x1, kEndHeaders = 0x4, kPadded = 0x8, kPriorityFlag = 0x20;
constexpr int64_t kMaxWindow = 0x7fffffff;
constexpr uint32_t kOurMaxFrame = 1u << 20;  // what we accept; the server's limit for what we send is its own
constexpr int64_t kReplenishAt = 1 << 24;    // bytes received before the connection's window is topped up

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

void put_frame_header(uint8_t* out, uint32_t length, uint8_t type, uint8_t flags, uint32_t stream) {
  out[0] = (length >> 16) & 0xff;
  out[1] = (length >> 8) & 0xff;
  out[2] = length & 0xff;
  out[3] = type;
  out[4] = flags;
  out[5] = (stream >> 24) & 0x7f;
  out[6] = (stream >> 16) & 0xff;
  out[7] = (stream >> 8) & 0xff;
  out[8] = stream & 0xff;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

// HPACK integer with an N-bit prefix (RFC 7541, 5.1)
void hpack_int(std::string* out, uint8_t first, int bits, size_t value) {
  const size_t max = (size_t(1) << bits) - 1;
  if (value < max) {
    out->push_back(char(first | value));
    return;
  }
  out->push_back(char(first | max));
  value -= max;
  while (value >= 128) {
    out->push_back(char((value & 127) | 128));
    value >>= 7;
  }
  out->push_back(char(value));
}

void hpack_string(std::string* out, const std::string& s) {
  hpack_int(out, 0x00, 7, s.size());  // H = 0: raw octets
  out->append(s);
}

// "literal header field without indexing" (0000 prefix), its name a static-table index (0: a literal name)
void hpack_literal(std::string* out, size_t name_index, const std::string& name, const std::string& value) {
  hpack_int(out, 0x00, 4, name_index);
  if (name_index == 0) hpack_string(out, name);
  hpack_string(out, value);
}

// A growable byte buffer that leaves what it grows by unwritten (std::vector would zero every answer's bytes first).
class Bytes {
 public:
  Bytes() = default;
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;
  ~Bytes() { free(p_); }
  bool reserve(size_t want) {
    if (want <= cap_) return true;
    const size_t cap = std::max(want, cap_ * 2);
    void* q = realloc(p_, cap);
    if (q == nullptr) return false;
    p_ = static_cast<uint8_t*>(q);
    cap_ = cap;
    return true;
  }
  bool append(const uint8_t* src, size_t k) {
    if (!reserve(n_ + k)) return false;
    memcpy(p_ + n_, src, k);
    n_ += k;
    return true;
  }
  uint8_t* end() { return p_ + n_; }  // then grew(k) once k bytes are written there (within reserve)
  void grew(size_t k) { n_ += k; }
  void clear() { n_ = 0; }
  bool empty() const { return n_ == 0; }
  size_t size() const { return n_; }
  const uint8_t* data() const { return p_; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0, cap_ = 0;
};

}  // namespace

struct kk_h2c {
  std::string host;
  int port = 0;
  int fd = -1;
  uint32_t next_stream = 1;
  int64_t conn_send_window = 65535;
  int64_t peer_initial_window = 65535;
  uint32_t peer_max_frame = 16384;
  int64_t unacked_received = 0;  // connection-level DATA bytes not yet given back with a WINDOW_UPDATE
  std::vector<uint8_t> rbuf;     // bytes read and not yet parsed: [rpos, rlen)
  size_t rpos = 0, rlen = 0;
  std::string error;
  bool timed_out = false;  // the last failure was the call's deadline
  bool unprocessed = false;  // the last failure was a stream the server refused unseen: safe to send again
  // the current call
  uint32_t stream = 0;
  int64_t stream_send_window = 0;
  Bytes body;  // the answer's DATA, the gRPC prefix included
  std::string block;                   // the header block being gathered (HEADERS + CONTINUATION)
  std::vector<std::string> blocks;     // complete header blocks of this stream, in order
  bool block_ends_stream = false;
  bool stream_done = false;
  // kept from call to call: the request's encoded headers (for the last path) and the send's frame headers and iovecs
  std::string headers_path, headers;
  std::vector<uint8_t> frame_headers;
  std::vector<iovec> iov;
};

namespace {

bool fail(kk_h2c* c, const std::string& what) {
  c->error = what;
  return false;
}

void drop(kk_h2c* c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  c->rpos = c->rlen = 0;
}

bool send_iov(kk_h2c* c, iovec* iov, int count) {
  while (count > 0) {
    msghdr message{};
    message.msg_iov = iov;
    message.msg_iovlen = size_t(count > IOV_MAX ? IOV_MAX : count);
    // MSG_NOSIGNAL: a peer that closed the connection is an error to report, not a SIGPIPE for the process
    ssize_t n = sendmsg(c->fd, &message, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        c->timed_out = true;
        return fail(c, "the request could not be sent within the deadline");
      }
      return fail(c, std::string("sending failed: ") + strerror(errno));
    }
    while (count > 0 && size_t(n) >= iov->iov_len) {
      n -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= n;
    }
  }
  return true;
}

bool send_bytes(kk_h2c* c, const void* data, size_t n) {
  iovec iov{const_cast<void*>(data), n};
  return send_iov(c, &iov, 1);
}

bool send_frame(kk_h2c* c, uint8_t type, uint8_t flags, uint32_t stream, const void* payload, uint32_t n) {
  uint8_t header[9];
  put_frame_header(header, n, type, flags, stream);
  iovec iov[2] = {{header, 9}, {const_cast<void*>(payload), n}};
  return send_iov(c, iov, n ? 2 : 1);
}

// up to `cap` bytes from the socket into `dst`, waiting until `deadline`: how many, or -1 (c->error says why)
ssize_t recv_some(kk_h2c* c, uint8_t* dst, size_t cap, double deadline) {
  for (;;) {
    const double left = deadline - now_s();
    if (left <= 0) {
      c->timed_out = true;
      fail(c, "no answer within the deadline");
      return -1;
    }
    pollfd p{c->fd, POLLIN, 0};
    int ready = poll(&p, 1, int(left * 1000) + 1);
    if (ready < 0 && errno != EINTR) return fail(c, std::string("poll failed: ") + strerror(errno)), -1;
    if (ready <= 0) continue;
    ssize_t n = recv(c->fd, dst, cap, 0);
    if (n == 0) return fail(c, "the server closed the connection"), -1;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return fail(c, std::string("receiving failed: ") + strerror(errno)), -1;
    }
    return n;
  }
}

// the unparsed bytes moved to rbuf's start, and room behind them for at least `need` in all (and a good read)
void make_room(kk_h2c* c, size_t need) {
  if (c->rpos > 0) {
    memmove(c->rbuf.data(), c->rbuf.data() + c->rpos, c->rlen - c->rpos);
    c->rlen -= c->rpos;
    c->rpos = 0;
  }
  if (c->rbuf.size() < need || c->rbuf.size() - c->rlen < 65536) c->rbuf.resize(std::max(need, c->rlen + 262144));
}

// whether a whole frame (header and payload) is buffered
bool frame_buffered(const kk_h2c* c) {
  if (c->rlen - c->rpos < 9) return false;
  const uint8_t* h = c->rbuf.data() + c->rpos;
  return c->rlen - c->rpos >= 9 + ((size_t(h[0]) << 16) | (size_t(h[1]) << 8) | h[2]);
}

// at least `need` unparsed bytes in rbuf, reading until `deadline`
bool fill(kk_h2c* c, size_t need, double deadline) {
  if (c->rlen - c->rpos >= need) return true;
  make_room(c, need);
  while (c->rlen < need) {
    const ssize_t n = recv_some(c, c->rbuf.data() + c->rlen, c->rbuf.size() - c->rlen, deadline);
    if (n < 0) return false;
    c->rlen += size_t(n);
  }
  return true;
}

// A DATA frame of the call's stream without padding, its header parsed: the payload goes straight into the answer,
// what is buffered first and the rest read from the socket into place (one copy fewer of every answer's bytes).
bool data_into_body(kk_h2c* c, uint32_t length, uint8_t flags, double deadline) {
  c->unacked_received += length;
  const size_t have = std::min<size_t>(c->rlen - c->rpos, length);
  if (!c->body.reserve(c->body.size() + length)) return fail(c, "out of memory for the answer");
  c->body.append(c->rbuf.data() + c->rpos, have);
  c->rpos += have;
  for (size_t left = length - have; left > 0;) {
    const ssize_t n = recv_some(c, c->body.end(), left, deadline);
    if (n < 0) return false;
    c->body.grew(size_t(n));
    left -= size_t(n);
  }
  if (flags & kEndStream) c->stream_done = true;
  return true;
}

// strips PADDED (and, for HEADERS, PRIORITY) from a frame's payload
bool unpad(kk_h2c* c, uint8_t flags, bool priority, const uint8_t** p, uint32_t* n) {
  uint32_t pad = 0;
  if (flags & kPadded) {
    if (*n < 1) return fail(c, "protocol error: a padded frame without its pad length");
    pad = (*p)[0];
    ++*p;
    --*n;
  }
  if (priority && (flags & kPriorityFlag)) {
    if (*n < 5) return fail(c, "protocol error: a HEADERS frame too short for its priority");
    *p += 5;
    *n -= 5;
  }
  if (pad > *n) return fail(c, "protocol error: padding longer than the frame");
  *n -= pad;
  return true;
}

void apply_settings(kk_h2c* c, const uint8_t* p, uint32_t n) {
  for (uint32_t i = 0; i + 6 <= n; i += 6) {
    const uint16_t id = uint16_t((p[i] << 8) | p[i + 1]);
    const uint32_t value = be32(p + i + 2);
    if (id == 0x4) {  // SETTINGS_INITIAL_WINDOW_SIZE: applies to open streams too, by its change
      if (c->stream) c->stream_send_window += int64_t(value) - c->peer_initial_window;
      c->peer_initial_window = value;
    } else if (id == 0x5) {
      c->peer_max_frame = value;
    }
  }
}

// reads and handles one frame; the call's state is updated as frames of its stream arrive
bool one_frame(kk_h2c* c, double deadline) {
  if (!fill(c, 9, deadline)) return false;
  const uint8_t* h = c->rbuf.data() + c->rpos;
  const uint32_t length = (uint32_t(h[0]) << 16) | (uint32_t(h[1]) << 8) | h[2];
  const uint8_t type = h[3], flags = h[4];
  const uint32_t stream = be32(h + 5) & 0x7fffffff;
  if (length > kOurMaxFrame) return fail(c, "protocol error: a frame larger than the size we allowed");
  if (type == kData && c->stream != 0 && stream == c->stream && !(flags & kPadded)) {
    c->rpos += 9;
    return data_into_body(c, length, flags, deadline);
  }
  if (!fill(c, 9 + size_t(length), deadline)) return false;
  const uint8_t* p = c->rbuf.data() + c->rpos + 9;
  uint32_t n = length;
  c->rpos += 9 + length;
  const bool ours = c->stream != 0 && stream == c->stream;
  switch (type) {
    case kSettings:
      if (!(flags & kAck)) {
        apply_settings(c, p, n);
        return send_frame(c, kSettings, kAck, 0, nullptr, 0);
      }
      return true;
    case kPing:
      if (!(flags & kAck)) return send_frame(c, kPing, kAck, 0, p, n);
      return true;
    case kWindowUpdate: {
      if (n != 4) return fail(c, "protocol error: a WINDOW_UPDATE that is not 4 bytes");
      const int64_t increment = be32(p) & 0x7fffffff;
      if (stream == 0) c->conn_send_window += increment;
      else if (ours) c->stream_send_window += increment;
      return true;
    }
    case kData:
      c->unacked_received += length;  // flow control counts the padding too
      if (!ours) return true;
      if (!unpad(c, flags, false, &p, &n)) return false;
      if (!c->body.append(p, n)) return fail(c, "out of memory for the answer");
      if (flags & kEndStream) c->stream_done = true;
      return true;
    case kHeaders:
    case kContinuation:
      if (!ours) return true;  // a late frame of a stream we gave up on (its blocks need no state: table size 0)
      if (type == kHeaders) {
        if (!unpad(c, flags, true, &p, &n)) return false;
        c->block.clear();
        c->block_ends_stream = flags & kEndStream;
      }
      c->block.append(reinterpret_cast<const char*>(p), n);
      if (flags & kEndHeaders) {
        c->blocks.push_back(std::move(c->block));
        c->block.clear();
        if (c->block_ends_stream) c->stream_done = true;
      }
      return true;
    case kRstStream: {
      if (!ours) return true;
      const uint32_t code = n == 4 ? be32(p) : 0;
      c->unprocessed = code == 0x7;  // REFUSED_STREAM: not processed (RFC 9113, 8.7)
      return fail(c, "the server reset the stream (RST_STREAM, HTTP/2 error code " + std::to_string(code) + ")");
    }
    case kGoAway: {
      const uint32_t last = n >= 4 ? be32(p) & 0x7fffffff : 0, code = n >= 8 ? be32(p + 4) : 0;
      const std::string debug = n > 8 ? std::string(reinterpret_cast<const char*>(p + 8), n - 8) : "";
      c->unprocessed = c->stream > last;  // streams above the last one it names were not processed
      drop(c);
      return fail(c, "the server closed the connection (GOAWAY, HTTP/2 error code " + std::to_string(code) +
                          (debug.empty() ? ")" : "): " + debug));
    }
    case kPushPromise:
      return fail(c, "protocol error: PUSH_PROMISE although push was disabled");
    default:
      return true;  // PRIORITY and unknown frame types are ignored, as the RFC says
  }
}

// What came while the connection sat idle is handled before a request goes out on it: a PING or SETTINGS is
// answered, and a GOAWAY or a close (a server restarted, an idle connection dropped) leaves the connection closed,
// so the call opens a fresh one instead of failing on the old.
void settle_idle(kk_h2c* c, double deadline) {
  while (c->fd >= 0) {
    while (c->fd >= 0 && frame_buffered(c)) {  // frames already whole: some come behind the last answer
      if (!one_frame(c, deadline)) drop(c);
    }
    if (c->fd < 0) return;
    pollfd p{c->fd, POLLIN, 0};
    if (poll(&p, 1, 0) <= 0) return;
    make_room(c, 0);
    ssize_t n = recv(c->fd, c->rbuf.data() + c->rlen, c->rbuf.size() - c->rlen, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
      drop(c);
      return;
    }
    if (n > 0) c->rlen += size_t(n);
  }
}

bool open_connection(kk_h2c* c, double timeout_s) {
  drop(c);
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(c->port);
  int rc = getaddrinfo(c->host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) return fail(c, "cannot resolve " + c->host + ": " + gai_strerror(rc));
  std::string last = "no address";
  for (addrinfo* a = found; a != nullptr && c->fd < 0; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    timeval tv{long(timeout_s), long((timeout_s - long(timeout_s)) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);  // connect and every send give up after the timeout
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      c->fd = fd;
    } else {
      last = strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (c->fd < 0) return fail(c, "cannot connect to " + c->host + ":" + port + ": " + last);
  int one = 1;
  setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  c->next_stream = 1;
  c->conn_send_window = c->peer_initial_window = 65535;
  c->peer_max_frame = 16384;
  c->unacked_received = 0;
  c->stream = 0;
  static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  // SETTINGS: HEADER_TABLE_SIZE 0, ENABLE_PUSH 0, INITIAL_WINDOW_SIZE 2^31-1, MAX_FRAME_SIZE 1 MiB
  const uint32_t settings[][2] = {{0x1, 0}, {0x2, 0}, {0x4, uint32_t(kMaxWindow)}, {0x5, kOurMaxFrame}};
  uint8_t out[24 + 9 + 24 + 9 + 4];
  memcpy(out, preface, 24);
  put_frame_header(out + 24, 24, kSettings, 0, 0);
  for (int i = 0; i < 4; ++i) {
    uint8_t* s = out + 33 + 6 * i;
    s[0] = uint8_t(settings[i][0] >> 8);
    s[1] = uint8_t(settings[i][0]);
    s[2] = uint8_t(settings[i][1] >> 24);
    s[3] = uint8_t(settings[i][1] >> 16);
    s[4] = uint8_t(settings[i][1] >> 8);
    s[5] = uint8_t(settings[i][1]);
  }
  const uint32_t increment = uint32_t(kMaxWindow - 65535);
  put_frame_header(out + 57, 4, kWindowUpdate, 0, 0);
  out[66] = uint8_t((increment >> 24) & 0x7f);
  out[67] = uint8_t(increment >> 16);
  out[68] = uint8_t(increment >> 8);
  out[69] = uint8_t(increment);
  if (!send_bytes(c, out, sizeof out)) {
    drop(c);
    return false;
  }
  return true;
}

// One attempt: the request on the next stream, then frames until that stream ends. False: it failed (c->error).
bool send_and_receive(kk_h2c* c, const char* path, const uint8_t* request, uint64_t request_len, double deadline) {
  c->stream = c->next_stream;
  c->next_stream += 2;
  c->stream_send_window = c->peer_initial_window;
  c->body.clear();
  c->blocks.clear();
  c->block.clear();
  c->stream_done = false;

  if (c->headers.empty() || c->headers_path != path) {  // encoded once per path: the block has no dynamic state
    std::string& headers = c->headers;  // :method POST, :scheme http (static indices 3, 6), then literals
    headers.assign({char(0x83), char(0x86)});
    hpack_literal(&headers, 4, "", path);                                    // :path
    hpack_literal(&headers, 1, "", c->host + ":" + std::to_string(c->port));  // :authority
    hpack_literal(&headers, 31, "", "application/grpc");                     // content-type
    hpack_literal(&headers, 0, "te", "trailers");
    c->headers_path = path;
  }
  const std::string& headers = c->headers;
  uint8_t prefix[5] = {0, uint8_t(request_len >> 24), uint8_t(request_len >> 16), uint8_t(request_len >> 8),
                       uint8_t(request_len)};
  if (request_len > 0xffffffffull) return fail(c, "the request is larger than gRPC's 4 GiB message limit");

  // HEADERS, then DATA frames within the server's frame size and windows; each sendmsg carries what is ready
  std::vector<uint8_t>& frame_headers = c->frame_headers;
  frame_headers.clear();
  frame_headers.reserve(9 * 8);  // a fixed capacity: flushed before it would grow (the iovecs point into it)
  std::vector<iovec>& iov = c->iov;
  iov.clear();
  uint8_t update[13], hdr[9];
  bool ok = true;
  if (c->unacked_received >= kReplenishAt) {  // give the connection's window back ahead of this call
    put_frame_header(update, 4, kWindowUpdate, 0, 0);
    const uint32_t inc = uint32_t(c->unacked_received);
    update[9] = uint8_t((inc >> 24) & 0x7f);
    update[10] = uint8_t(inc >> 16);
    update[11] = uint8_t(inc >> 8);
    update[12] = uint8_t(inc);
    iov.push_back({update, 13});
    c->unacked_received = 0;
  }
  put_frame_header(hdr, uint32_t(headers.size()), kHeaders, kEndHeaders, c->stream);
  iov.push_back({hdr, 9});
  iov.push_back({const_cast<char*>(headers.data()), headers.size()});
  const uint64_t total = 5 + request_len;
  uint64_t sent = 0;
  while (ok && sent < total) {
    const int64_t window = std::min(c->conn_send_window, c->stream_send_window);
    if (window <= 0) {  // send what is ready, then wait for the server's WINDOW_UPDATE
      if (!iov.empty()) {
        ok = send_iov(c, iov.data(), int(iov.size()));
        iov.clear();
        frame_headers.clear();
        if (!ok) break;
      }
      ok = one_frame(c, deadline);
      if (ok && c->stream_done) break;  // the server answered before the request was whole (an error status)
      continue;
    }
    const uint64_t chunk = std::min<uint64_t>({total - sent, uint64_t(c->peer_max_frame), uint64_t(window)});
    if (frame_headers.size() + 9 > frame_headers.capacity()) {  // keep the iovecs' pointers stable: flush first
      ok = send_iov(c, iov.data(), int(iov.size()));
      iov.clear();
      frame_headers.clear();
    }
    const size_t at = frame_headers.size();
    frame_headers.resize(at + 9);
    put_frame_header(&frame_headers[at], uint32_t(chunk), kData, sent + chunk == total ? kEndStream : 0, c->stream);
    iov.push_back({&frame_headers[at], 9});
    uint64_t from = sent, left = chunk;
    if (from < 5) {
      const uint64_t take = std::min<uint64_t>(5 - from, left);
      iov.push_back({prefix + from, size_t(take)});
      from += take;
      left -= take;
    }
    if (left > 0) iov.push_back({const_cast<uint8_t*>(request) + (from - 5), size_t(left)});
    sent += chunk;
    c->conn_send_window -= int64_t(chunk);
    c->stream_send_window -= int64_t(chunk);
  }
  if (ok && !iov.empty()) ok = send_iov(c, iov.data(), int(iov.size()));
  while (ok && !c->stream_done) ok = one_frame(c, deadline);
  c->stream = 0;
  return ok;
}

}  // namespace

extern "C" {

// What a finished call hands back; the pointers stay valid until the connection's next call.
struct kk_h2c_result {
  const uint8_t* message;  // the response message (after gRPC's 5-byte prefix); null when none came
  uint64_t message_len;
  const uint8_t* headers;   // the first header block (a trailers-only answer's only block)
  uint64_t headers_len;
  const uint8_t* trailers;  // the last header block when there are two or more, else null
  uint64_t trailers_len;
};

__attribute__((visibility("default"))) kk_h2c* kk_h2c_new(const char* host, int port) {
  kk_h2c* c = new kk_h2c;
  c->host = host;
  c->port = port;
  return c;
}

__attribute__((visibility("default"))) void kk_h2c_free(kk_h2c* c) {
  if (c == nullptr) return;
  drop(c);
  delete c;
}

__attribute__((visibility("default"))) const char* kk_h2c_error(kk_h2c* c) { return c->error.c_str(); }

// One unary call on `path` with `request` (a serialized protobuf message). 0: the stream ended (the status is in
// the header blocks); -1: it failed, -2: its deadline passed (kk_h2c_error says why; the connection is reopened by
// the next call).
__attribute__((visibility("default"))) int kk_h2c_call(kk_h2c* c, const char* path, const uint8_t* request,
                                                       uint64_t request_len, double timeout_s,
                                                       kk_h2c_result* result) {
  const double deadline = now_s() + timeout_s;
  memset(result, 0, sizeof *result);
  for (int attempt = 0;; ++attempt) {
    c->error.clear();
    c->timed_out = c->unprocessed = false;
    settle_idle(c, deadline);
    if (c->fd < 0 || c->next_stream > 0x7ffffff0u) {
      if (!open_connection(c, std::max(deadline - now_s(), 0.001))) return -1;
    }
    if (send_and_receive(c, path, request, request_len, deadline)) break;
    drop(c);  // a broken or abandoned stream: the next call starts on a fresh connection
    if (!(c->unprocessed && attempt == 0)) return c->timed_out ? -2 : -1;
  }  // a stream refused unseen (a GOAWAY that came as it was sent) is sent once more, on a fresh connection

  if (!c->blocks.empty()) {
    result->headers = reinterpret_cast<const uint8_t*>(c->blocks.front().data());
    result->headers_len = c->blocks.front().size();
  }
  if (c->blocks.size() >= 2) {
    result->trailers = reinterpret_cast<const uint8_t*>(c->blocks.back().data());
    result->trailers_len = c->blocks.back().size();
  }
  if (!c->body.empty()) {
    if (c->body.size() < 5) return fail(c, "a gRPC message shorter than its 5-byte prefix"), -1;
    if (c->body.data()[0] != 0) return fail(c, "the server compressed its answer, which was not asked for"), -1;
    const uint64_t n = be32(c->body.data() + 1);
    if (n + 5 != c->body.size())
      return fail(c, "the answer is not one gRPC message (" + std::to_string(c->body.size()) + " bytes for a " +
                         std::to_string(n) + "-byte message)"), -1;
    result->message = c->body.data() + 5;
    result->message_len = n;
  }
  return 0;
}

}  // extern "C"
