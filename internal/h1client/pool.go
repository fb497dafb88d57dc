package h1client

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/url"
	"sync"
	"time"
)

// pools holds the idle connections of every host a Transport (and its WithAuthorization
// copies) has called.
type pools struct {
	opts   Options
	dialer *net.Dialer
	mu     sync.Mutex
	m      map[string]*hostPool // by scheme://host:port
}

// hostPool is one host's idle connections, the most recently used last: it is taken first,
// so that connections beyond the load's need age out on the idle timer.
type hostPool struct {
	idle []*conn
}

// get returns an idle connection to u's host that is still open, or dials one, and tells
// which it did.
func (p *pools) get(ctx context.Context, u *url.URL, key string) (*conn, bool, error) {
	for {
		c := p.take(key)
		if c == nil {
			break
		}
		if c.br.Buffered() == 0 && alive(c.nc) {
			return c, true, nil
		}
		// The server closed it, or sent something unasked, while it was idle.
		c.nc.Close()
	}
	c, err := p.dial(ctx, u, key)
	return c, false, err
}

func (p *pools) take(key string) *conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	hp := p.m[key]
	if hp == nil || len(hp.idle) == 0 {
		return nil
	}
	c := hp.idle[len(hp.idle)-1]
	hp.idle[len(hp.idle)-1] = nil
	hp.idle = hp.idle[:len(hp.idle)-1]
	c.idleTimer.Stop() // if it fired already, its remove finds nothing
	return c
}

// put makes c idle, or closes it when its host has enough idle connections.
func (p *pools) put(c *conn) {
	p.mu.Lock()
	hp := p.m[c.key]
	if hp == nil {
		hp = &hostPool{}
		p.m[c.key] = hp
	}
	if len(hp.idle) >= p.opts.MaxIdlePerHost {
		p.mu.Unlock()
		c.nc.Close()
		return
	}
	hp.idle = append(hp.idle, c)
	if c.idleTimer == nil {
		c.idleTimer = time.AfterFunc(p.opts.IdleTimeout, func() { p.remove(c) })
	} else {
		c.idleTimer.Reset(p.opts.IdleTimeout)
	}
	p.mu.Unlock()
}

// remove closes c if it is still idle: its idle timer fired.
func (p *pools) remove(c *conn) {
	p.mu.Lock()
	hp := p.m[c.key]
	found := false
	if hp != nil {
		for i, ic := range hp.idle {
			if ic == c {
				hp.idle = append(hp.idle[:i], hp.idle[i+1:]...)
				found = true
				break
			}
		}
		if len(hp.idle) == 0 {
			delete(p.m, c.key)
		}
	}
	p.mu.Unlock()
	if found {
		c.nc.Close()
	}
}

func (p *pools) closeIdle() {
	p.mu.Lock()
	var all []*conn
	for key, hp := range p.m {
		all = append(all, hp.idle...)
		delete(p.m, key)
	}
	p.mu.Unlock()
	for _, c := range all {
		c.idleTimer.Stop()
		c.nc.Close()
	}
}

// dial connects to u's host, with TLS for https. A failed TCP connect comes back as the
// dialer's *net.OpError (Op "dial"), a failed handshake as an UnsentError: either way the
// backend provably never saw the request.
func (p *pools) dial(ctx context.Context, u *url.URL, key string) (*conn, error) {
	addr := canonicalAddr(u)
	nc, err := p.dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if u.Scheme == "https" {
		cfg := p.opts.TLS.Clone()
		if cfg.ServerName == "" {
			cfg.ServerName = u.Hostname()
		}
		// Engines speak HTTP/1.1; offering only it keeps a server from choosing h2.
		cfg.NextProtos = []string{"http/1.1"}
		tc := tls.Client(nc, cfg)
		hctx, cancel := context.WithTimeout(ctx, p.opts.TLSHandshakeTimeout)
		err := tc.HandshakeContext(hctx)
		cancel()
		if err != nil {
			nc.Close()
			// No byte of the request went out.
			return nil, &UnsentError{Err: fmt.Errorf("tls handshake with %s: %w", addr, err)}
		}
		nc = tc
	}
	return &conn{nc: nc, br: bufio.NewReaderSize(nc, readerSize), key: key, p: p}, nil
}
