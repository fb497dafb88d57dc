package kvcache

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// maxFrame bounds one ZMTP frame a subscriber accepts. zmq4 allocates a frame's body at the
// size its header claims, up to 2^63 bytes, before reading it: without a bound, one peer
// of the listening socket could make the proxy allocate without limit (and crash) with a
// 10-byte header. A batch of events is far smaller: one BlockStored of a million tokens is
// about 5 MiB.
const maxFrame = 32 << 20

// maxMessage and maxMessageFrames bound one ZMTP message (its frames up to one without the
// MORE flag): zmq4 keeps every frame of a message until the last, so without them a peer holds
// any memory it likes in frames each under maxFrame, or in millions of empty ones. A KV event
// message is 3 frames (topic, 8-byte sequence, payload), a replay answer 3 (empty, sequence,
// payload; 4 where a publisher puts the topic before the sequence), a ZMTP command 1.
// maxMessageFrames leaves room for a publisher that adds a frame or two: its messages are then
// dropped one by one as not [topic, sequence, payload], and counted, rather than its
// connection. maxMessage lets a payload of maxFrame pass with its topic.
const (
	maxMessage       = maxFrame + 64<<10
	maxMessageFrames = 8
)

// zmtpGreeting is the length of ZMTP 3's greeting, which precedes the frames.
const zmtpGreeting = 64

// boundedTCP names zmq4's TCP transport with every connection's frames bounded by maxFrame.
// The subscribers' endpoints are written "tcp://..." and mapped to it.
const boundedTCP = "pdproxy-tcp"

// acceptedConn names a transport whose dial hands zmq4 a connection the listening socket
// accepted. Each accepted connection gets a SUB socket of its own, dialed over it: zmq4's
// messages do not say which connection brought them, and one socket per connection ties every
// message to its peer's address.
const acceptedConn = "pdproxy-accepted"

// registerTransport registers boundedTCP and acceptedConn with zmq4, once per process: zmq4
// keeps its transports in a registry of its own, which nothing here can hold per instance.
var registerTransport = sync.OnceValue(func() error {
	if err := zmq4.RegisterTransport(boundedTCP, boundedTransport{transport.New("tcp")}); err != nil {
		return err
	}
	return zmq4.RegisterTransport(acceptedConn, acceptedTransport{})
})

// handoff holds the accepted connections on their way to a SUB socket's dial, by an endpoint
// never reused. It is per process as zmq4's transports are; an entry lives from adopt to the
// dial (or the release, when no dial took it), one handshake at most.
var handoff = struct {
	sync.Mutex
	next  uint64
	conns map[string]net.Conn
}{conns: make(map[string]net.Conn)}

// adopt returns the endpoint whose dial yields c, and a release that forgets c if no dial
// took it.
func adopt(c net.Conn) (endpoint string, release func()) {
	handoff.Lock()
	handoff.next++
	key := strconv.FormatUint(handoff.next, 10)
	handoff.conns[key] = c
	handoff.Unlock()
	return acceptedConn + "://" + key, func() {
		handoff.Lock()
		delete(handoff.conns, key)
		handoff.Unlock()
	}
}

type acceptedTransport struct{}

func (acceptedTransport) Dial(_ context.Context, _ transport.Dialer, addr string) (net.Conn, error) {
	handoff.Lock()
	defer handoff.Unlock()
	c, ok := handoff.conns[addr]
	if !ok {
		return nil, fmt.Errorf("kv events: no accepted connection %q", addr)
	}
	delete(handoff.conns, addr)
	return c, nil
}

func (acceptedTransport) Listen(context.Context, string) (net.Listener, error) {
	return nil, errors.New("kv events: an accepted connection's transport does not listen")
}

func (acceptedTransport) Addr(ep string) (string, error) { return ep, nil }

// bounded maps a tcp:// endpoint to boundedTCP.
func bounded(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return boundedTCP + "://" + rest
	}
	return ep
}

type boundedTransport struct{ tcp transport.Transport }

func (t boundedTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.tcp.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return &boundedConn{Conn: c, greeting: zmtpGreeting}, nil
}

func (t boundedTransport) Listen(context.Context, string) (net.Listener, error) {
	// The listening socket accepts its connections itself (Events.serve).
	return nil, errors.New("kv events: the bounded tcp transport only dials")
}

func (t boundedTransport) Addr(ep string) (string, error) { return t.tcp.Addr(ep) }

// errTooLarge ends a connection whose peer announced a frame over maxFrame or a message over
// maxMessage or maxMessageFrames.
var errTooLarge = errors.New("kv events: ZMTP frame or message over the size limit")

// boundedConn follows the ZMTP 3 framing of what it reads (the greeting, then frames of a
// flags byte, a 1- or 8-byte size and a body) and fails the read that brings a frame header
// announcing more than maxFrame bytes, or a frame that takes its message over maxMessage bytes
// or maxMessageFrames frames, before zmq4 allocates for it.
type boundedConn struct {
	net.Conn
	// over is set once a read failed with errTooLarge: the connection's owner counts it.
	over atomic.Bool
	// greeting is how many greeting bytes are still to pass.
	greeting int
	// sizeLen is how many size bytes the current header still has (0: expecting flags);
	// long is set for an 8-byte size, collected in size.
	sizeLen int
	long    bool
	size    uint64
	// body is how many body bytes of the current frame are still to pass.
	body uint64
	// more is the MORE flag of the current frame; frames and bytes count the current
	// message's frames and body bytes so far.
	more          bool
	frames, bytes uint64
}

// ZMTP 3 frame flags.
const (
	flagMore = 0x01
	flagLong = 0x02
)

func (c *boundedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if ferr := c.follow(p[:n]); ferr != nil {
		c.over.Store(true)
		c.Conn.Close()
		return 0, ferr
	}
	return n, err
}

func (c *boundedConn) follow(b []byte) error {
	for len(b) > 0 {
		switch {
		case c.greeting > 0:
			k := min(c.greeting, len(b))
			c.greeting -= k
			b = b[k:]
		case c.body > 0:
			k := uint64(len(b))
			if k > c.body {
				k = c.body
			}
			c.body -= k
			b = b[k:]
		case c.sizeLen == 0:
			if !c.more { // the previous frame ended its message
				c.frames, c.bytes = 0, 0
			}
			c.more = b[0]&flagMore != 0
			c.frames++
			if c.frames > maxMessageFrames {
				return fmt.Errorf("%w: a message of more than %d frames", errTooLarge, maxMessageFrames)
			}
			c.long = b[0]&flagLong != 0
			c.sizeLen, c.size = 1, 0
			if c.long {
				c.sizeLen = 8
			}
			b = b[1:]
		default:
			c.size = c.size<<8 | uint64(b[0]) // big-endian
			c.sizeLen--
			b = b[1:]
			if c.sizeLen == 0 {
				if c.size > maxFrame {
					return fmt.Errorf("%w: a frame of %d bytes announced, at most %d", errTooLarge, c.size, maxFrame)
				}
				c.bytes += c.size
				if c.bytes > maxMessage {
					return fmt.Errorf("%w: a message of more than %d bytes", errTooLarge, maxMessage)
				}
				c.body = c.size
			}
		}
	}
	return nil
}
