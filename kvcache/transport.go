package kvcache

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// maxFrame bounds one ZMTP frame a subscriber accepts. zmq4 allocates a frame's body at the
// size its header claims, up to 2^63 bytes, before reading it: without a bound, one peer
// of the listening socket could make the proxy allocate without limit (and crash) with a
// 10-byte header. A batch of events is far smaller: one BlockStored of a million tokens is
// about 5 MiB.
const maxFrame = 32 << 20

// zmtpGreeting is the length of ZMTP 3's greeting, which precedes the frames.
const zmtpGreeting = 64

// boundedTCP names zmq4's TCP transport with every connection's frames bounded by maxFrame.
// The subscribers' endpoints are written "tcp://..." and mapped to it.
const boundedTCP = "pdproxy-tcp"

// registerTransport registers boundedTCP with zmq4, once per process: zmq4 keeps its
// transports in a registry of its own, which nothing here can hold per instance.
var registerTransport = sync.OnceValue(func() error {
	return zmq4.RegisterTransport(boundedTCP, boundedTransport{transport.New("tcp")})
})

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

func (t boundedTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.tcp.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return boundedListener{l}, nil
}

func (t boundedTransport) Addr(ep string) (string, error) { return t.tcp.Addr(ep) }

type boundedListener struct{ net.Listener }

func (l boundedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &boundedConn{Conn: c, greeting: zmtpGreeting}, nil
}

// errFrameTooLarge ends a connection whose peer announced a frame over maxFrame.
var errFrameTooLarge = errors.New("kv events: ZMTP frame over the size limit")

// boundedConn follows the ZMTP 3 framing of what it reads (the greeting, then frames of a
// flags byte, a 1- or 8-byte size and a body) and fails the read that brings a frame header
// announcing more than maxFrame bytes, before zmq4 allocates for it.
type boundedConn struct {
	net.Conn
	// greeting is how many greeting bytes are still to pass.
	greeting int
	// sizeLen is how many size bytes the current header still has (0: expecting flags);
	// long is set for an 8-byte size, collected in size.
	sizeLen int
	long    bool
	size    uint64
	// body is how many body bytes of the current frame are still to pass.
	body uint64
}

// ZMTP 3 frame flags.
const (
	flagLong = 0x02
)

func (c *boundedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if ferr := c.follow(p[:n]); ferr != nil {
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
					return fmt.Errorf("%w: %d bytes announced, at most %d", errFrameTooLarge, c.size, maxFrame)
				}
				c.body = c.size
			}
		}
	}
	return nil
}
