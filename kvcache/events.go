package kvcache

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Defaults of EventsConfig.
const (
	DefaultReplayTimeout    = time.Second
	DefaultRedial           = time.Second
	DefaultHandshakeTimeout = 5 * time.Second
	// maxReplay is the most batches a gap is replayed for: vLLM's replay buffer keeps
	// 10000, and a jump further than that cannot be filled anyway.
	maxReplay = 10000
	// maxPeers bounds the connections the listening socket holds at once: an engine's data
	// parallel ranks publish apart, so a few per engine; past it a new connection is closed.
	maxPeers = 512
	// resolveEvery is how long a backend's host name resolved to the addresses its messages
	// may come from is believed; resolveTimeout bounds one resolution.
	resolveEvery   = 10 * time.Second
	resolveTimeout = 2 * time.Second
)

// Reasons of pdproxy_kv_events_dropped_total that are no message's content.
const (
	// reasonTooLarge: a connection closed for a frame over maxFrame or a message over
	// maxMessage bytes or maxMessageFrames frames.
	reasonTooLarge = "too_large"
	// reasonUnknownSource: a connection to the listening socket from an address that is no
	// backend's nor allowed, or a message whose topic names a backend at another address.
	reasonUnknownSource = "unknown_source"
	// reasonTooManyPeers: a connection to the listening socket past maxPeers.
	reasonTooManyPeers = "too_many_peers"
	reasonUnknownTopic = "unknown_topic"
)

// EventsConfig configures the KV event subscribers.
type EventsConfig struct {
	// Listen is a ZMQ endpoint, "tcp://10.0.0.2:5557", where a SUB socket binds for engines to
	// dial (vLLM's publisher with a non-wildcard endpoint, llm-d-style): each message's topic
	// "kv@<host:port>@<model>" names its engine by the host:port of the backend's URL, and is
	// taken only from a peer at that host's address or in SetAllowedSources. An empty host
	// binds loopback; "*" binds every address. Empty means none.
	Listen string
	// ReplayTimeout bounds one replay after a sequence gap. Zero means 1s.
	ReplayTimeout time.Duration
	// Redial is how long a subscriber waits before dialing (or binding) again. Zero means 1s.
	Redial time.Duration
	// HandshakeTimeout bounds a connection's ZMTP greeting and handshake, dialed or
	// accepted. Zero means 5s.
	HandshakeTimeout time.Duration
}

// Endpoint is one engine's KV events as the router knows them.
type Endpoint struct {
	// Engine is the backend's name: the index's and the metrics' name for it.
	Engine string
	// HostPort is the host:port of the backend's URL, which a topic on the listening socket
	// names.
	HostPort string
	// Dial is the engine's PUB endpoint, "tcp://host:5557", to dial; empty means the engine
	// dials Listen, if anything.
	Dial string
	// Replay is the engine's replay (ROUTER) endpoint; empty means none: a gap forgets the
	// engine.
	Replay string
	// Sources are the engine's publishers, one per data parallel rank, as the engine said
	// where it bound them (vLLM's GET /kv_event_sources): each is dialed, and its replay
	// asked, apart. When set, Dial and Replay are not used.
	Sources []Source
}

// Source is one publisher of an engine: its PUB endpoint to dial, "tcp://host:port", and its
// replay endpoint, empty for none.
type Source struct {
	Dial, Replay string
}

// dials are the publishers of ep to dial, each as an Endpoint of its own Dial and Replay,
// keyed by what tells them apart.
func (ep Endpoint) dials() map[string]Endpoint {
	out := make(map[string]Endpoint, max(1, len(ep.Sources)))
	if len(ep.Sources) == 0 {
		if ep.Dial != "" {
			out[ep.Engine] = Endpoint{Engine: ep.Engine, HostPort: ep.HostPort, Dial: ep.Dial, Replay: ep.Replay}
		}
		return out
	}
	for _, s := range ep.Sources {
		if s.Dial != "" {
			out[ep.Engine+" "+s.Dial] = Endpoint{Engine: ep.Engine, HostPort: ep.HostPort, Dial: s.Dial, Replay: s.Replay}
		}
	}
	return out
}

// Events subscribes to the engines' KV events and applies them to an Index: one SUB socket
// bound at Listen for the engines that dial in, one dialed per Endpoint.Dial. It checks each
// engine's sequence: a gap is replayed from the engine's replay endpoint or, failing that,
// forgets the engine; a sequence going back (a restarted engine) forgets it too. Nothing it
// receives can stop it: what cannot be decoded or attributed is dropped and counted. Run owns
// its goroutines.
type Events struct {
	cfg     EventsConfig
	index   *Index
	logger  *zap.Logger
	zlog    zmq4.Option
	metrics *metrics
	now     func() time.Time

	mu        sync.Mutex
	endpoints map[string]Endpoint // by engine
	// byHost names the engines at each HostPort: more than one when an engine serves in
	// both roles, as two backends.
	byHost  map[string][]string
	streams map[streamKey]*stream
	wake    chan struct{}
	// allowed are the sources whose messages on the listening socket may speak for any
	// backend; resolved caches the addresses of the backends' host names, for the hosts of
	// byHost only.
	allowed  []netip.Prefix
	resolved map[string]resolution

	addr  atomic.Pointer[net.Addr]
	bound chan struct{}
	once  sync.Once
}

// streamKey is one publisher: an engine's data parallel ranks publish apart, each with its
// own sequence.
type streamKey struct {
	engine string
	rank   int
}

type stream struct{ last uint64 }

// NewEvents returns subscribers for index; nothing runs until Run. A nil logger logs nothing;
// a nil reg registers no metrics.
func NewEvents(cfg EventsConfig, index *Index, logger *zap.Logger, reg prometheus.Registerer) (*Events, error) {
	if logger == nil {
		logger = zap.NewNop()
	}
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = DefaultReplayTimeout
	}
	if cfg.Redial <= 0 {
		cfg.Redial = DefaultRedial
	}
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if cfg.Listen != "" {
		if err := CheckEndpoint(cfg.Listen, true); err != nil {
			return nil, fmt.Errorf("kv_events.listen: %w", err)
		}
	}
	if err := registerTransport(); err != nil {
		return nil, fmt.Errorf("kv events: register the bounded tcp transport: %w", err)
	}
	e := &Events{
		cfg: cfg, index: index, logger: logger, metrics: newMetrics(index), now: time.Now,
		endpoints: make(map[string]Endpoint), byHost: make(map[string][]string), resolved: make(map[string]resolution),
		streams: make(map[streamKey]*stream), wake: make(chan struct{}, 1), bound: make(chan struct{}),
	}
	// zmq4 logs its connection troubles itself; they go to ours, at debug.
	std, err := zap.NewStdLogAt(logger.Named("zmq"), zap.DebugLevel)
	if err != nil {
		return nil, err
	}
	e.zlog = zmq4.WithLogger(std)
	if reg != nil {
		if err := e.metrics.register(reg); err != nil {
			return nil, fmt.Errorf("register kv event metrics: %w", err)
		}
	}
	return e, nil
}

// CheckEndpoint says what is wrong with a ZMQ endpoint, "tcp://host:port"; bind allows "*"
// for the host (every address) and port 0 (a free one).
func CheckEndpoint(ep string, bind bool) error {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return fmt.Errorf("%q is not tcp://host:port", ep)
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return fmt.Errorf("%q is not tcp://host:port: %w", ep, err)
	}
	if !bind && (host == "" || host == "*" || port == "0" || port == "*") {
		return fmt.Errorf("%q: a dialed endpoint names a host and a port", ep)
	}
	if port == "" {
		return fmt.Errorf("%q has no port", ep)
	}
	return nil
}

// ParseSource parses an allowed source: an IP address, "10.0.0.7", or a CIDR prefix,
// "10.0.0.0/24", with no bits set past its length.
func ParseSource(s string) (netip.Prefix, error) {
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%q is neither an IP address nor a CIDR prefix", s)
		}
		if a.Zone() != "" {
			return netip.Prefix{}, fmt.Errorf("%q has a zone, which a source address never has", s)
		}
		a = a.Unmap()
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q is neither an IP address nor a CIDR prefix: %w", s, err)
	}
	if p != p.Masked() {
		return netip.Prefix{}, fmt.Errorf("%q has bits set past its /%d: %v is the prefix it names", s, p.Bits(), p.Masked())
	}
	if p.Addr().Is4In6() {
		if p.Bits() < 96 {
			return netip.Prefix{}, fmt.Errorf("%q reaches past IPv4-mapped addresses", s)
		}
		p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	return p, nil
}

// SetEndpoints replaces the engines subscribed to. An engine no longer there is forgotten
// by the index, and its series go; a changed dial endpoint is dialed anew by Run.
func (e *Events) SetEndpoints(eps []Endpoint) {
	e.mu.Lock()
	next := make(map[string]Endpoint, len(eps))
	e.byHost = make(map[string][]string, len(eps))
	for _, ep := range eps {
		next[ep.Engine] = ep
		if ep.HostPort != "" {
			e.byHost[ep.HostPort] = append(e.byHost[ep.HostPort], ep.Engine)
		}
	}
	var gone []string
	for name := range e.endpoints {
		if _, ok := next[name]; !ok {
			gone = append(gone, name)
		}
	}
	e.endpoints = next
	for k := range e.streams {
		if _, ok := next[k.engine]; !ok {
			delete(e.streams, k)
		}
	}
	hosts := e.hostsLocked()
	for h := range e.resolved {
		if !hosts[h] {
			delete(e.resolved, h)
		}
	}
	e.mu.Unlock()
	for _, name := range gone {
		e.index.Forget(name)
		e.metrics.forget(name)
	}
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Addr is the listening socket's address once bound, nil before (or without Listen).
func (e *Events) Addr() net.Addr {
	if p := e.addr.Load(); p != nil {
		return *p
	}
	return nil
}

// Bound is closed once the listening socket is bound (never, without Listen).
func (e *Events) Bound() <-chan struct{} { return e.bound }

// dialer is one running subscriber of a dialed endpoint.
type dialer struct {
	ep     Endpoint
	cancel context.CancelFunc
	done   chan struct{}
}

// Run subscribes until ctx is done, then stops every subscriber and returns nil.
func (e *Events) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	if e.cfg.Listen != "" {
		wg.Go(func() { e.listen(ctx) })
	}
	running := make(map[string]*dialer)
	defer func() {
		for _, d := range running {
			d.cancel()
		}
		wg.Wait()
	}()
	for {
		e.reconcile(ctx, &wg, running)
		select {
		case <-ctx.Done():
			return nil
		case <-e.wake:
		}
	}
}

// reconcile starts a dialer for every endpoint to dial and stops those of endpoints gone or
// changed, waiting for them so that an engine's messages are never handled twice at once.
func (e *Events) reconcile(ctx context.Context, wg *sync.WaitGroup, running map[string]*dialer) {
	e.mu.Lock()
	want := make(map[string]Endpoint)
	for _, ep := range e.endpoints {
		for key, d := range ep.dials() {
			want[key] = d
		}
	}
	e.mu.Unlock()
	for name, d := range running {
		if ep, ok := want[name]; !ok || !sameDial(ep, d.ep) {
			d.cancel()
			<-d.done
			delete(running, name)
		}
	}
	for name, ep := range want {
		if _, ok := running[name]; ok {
			continue
		}
		dctx, cancel := context.WithCancel(ctx)
		d := &dialer{ep: ep, cancel: cancel, done: make(chan struct{})}
		running[name] = d
		wg.Go(func() {
			defer close(d.done)
			e.dial(dctx, ep)
		})
	}
}

// sameDial reports whether a and b dial the same publisher alike.
func sameDial(a, b Endpoint) bool {
	return a.Engine == b.Engine && a.HostPort == b.HostPort && a.Dial == b.Dial && a.Replay == b.Replay
}

// dial subscribes to one engine's PUB until ctx is done, dialing again every Redial while
// the engine is not there. The socket has one connection, so a receive error means the engine
// went away (a restart): a fresh socket dials again. This loop redials rather than zmq4's
// automatic reconnection, whose dials run in goroutines that Close does not wait for.
func (e *Events) dial(ctx context.Context, ep Endpoint) {
	failing := false
	for {
		d := net.Dialer{Timeout: e.cfg.Redial}
		c, err := d.DialContext(ctx, "tcp", strings.TrimPrefix(ep.Dial, "tcp://"))
		var sub zmq4.Socket
		var bc *boundedConn
		if err == nil {
			sub, bc, err = e.open(ctx, c)
		}
		if err == nil {
			failing = false
			e.logger.Info("kv events: subscribed", zap.String("backend", ep.Engine), zap.String("endpoint", ep.Dial))
			e.receive(ctx, sub, c, func([][]byte) ([]Endpoint, string) { return []Endpoint{ep}, "" })
			sub.Close()
			if bc.over.Load() {
				e.metrics.dropped.WithLabelValues(ep.Engine, reasonTooLarge).Inc()
			}
		} else if errors.Is(err, errTooLarge) {
			e.metrics.dropped.WithLabelValues(ep.Engine, reasonTooLarge).Inc()
		} else if !failing && ctx.Err() == nil {
			e.logger.Warn("kv events: dial failed; dialing again", zap.String("backend", ep.Engine),
				zap.String("endpoint", ep.Dial), zap.Duration("every", e.cfg.Redial), zap.Error(err))
			failing = true
		}
		if !sleep(ctx, e.cfg.Redial) {
			return
		}
	}
}

// open runs the ZMTP handshake of a SUB socket over c, within HandshakeTimeout: zmq4 greets
// and handshakes inside Dial with no deadline of its own, so a peer that says nothing would
// hold it forever. The socket has c as its only connection; on an error c is closed.
func (e *Events) open(ctx context.Context, c net.Conn) (zmq4.Socket, *boundedConn, error) {
	bc := &boundedConn{Conn: c, greeting: zmtpGreeting}
	if err := c.SetDeadline(time.Now().Add(e.cfg.HandshakeTimeout)); err != nil {
		c.Close()
		return nil, nil, err
	}
	// A handshake under way is no read that ctx would end.
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	ep, release := adopt(bc)
	defer release()
	// The socket lives until its owner closes it after receive, not until ctx ends: receive
	// reads it to its connection's end (see there).
	sub := zmq4.NewSub(context.WithoutCancel(ctx), e.zlog, zmq4.WithDialerMaxRetries(0))
	err := sub.SetOption(zmq4.OptionSubscribe, "")
	if err == nil {
		err = sub.Dial(ep)
	}
	if err == nil {
		err = c.SetDeadline(time.Time{})
	}
	if err != nil {
		sub.Close()
		c.Close()
		if bc.over.Load() {
			// zmq4 reads on as soon as its handshake is done: a peer that sends an oversized
			// message at once has its connection closed before the deadline is lifted.
			err = fmt.Errorf("%w (%v)", errTooLarge, err)
		}
		return nil, nil, err
	}
	return sub, bc, nil
}

// listen binds the SUB socket that engines dial, again every Redial until it binds, and
// receives until ctx is done.
func (e *Events) listen(ctx context.Context) {
	failing := false
	for ctx.Err() == nil {
		var lc net.ListenConfig
		ln, err := lc.Listen(ctx, "tcp", listenAddress(e.cfg.Listen))
		if err != nil {
			if !failing {
				// The proxy serves on: precise routing falls back to the approximate view.
				e.logger.Error("kv events: cannot listen; retrying", zap.String("listen", e.cfg.Listen), zap.Error(err))
				failing = true
			}
			if !sleep(ctx, e.cfg.Redial) {
				return
			}
			continue
		}
		addr := ln.Addr()
		e.addr.Store(&addr)
		e.once.Do(func() { close(e.bound) })
		e.logger.Info("kv events: listening", zap.String("addr", addr.String()))
		e.serve(ctx, ln)
	}
}

// listenAddress is the TCP address of a listen endpoint: an empty host is loopback, "*"
// every address.
func listenAddress(ep string) string {
	host, port, _ := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://")) // CheckEndpoint passed
	switch host {
	case "":
		host = "127.0.0.1"
	case "*":
		host = ""
	}
	if port == "*" {
		port = "0"
	}
	return net.JoinHostPort(host, port)
}

// serve accepts the listening socket's connections until ctx is done or ln fails, then
// closes ln and waits for the connections' goroutines. Each connection's handshake runs in its
// own goroutine, so a peer that never greets holds up no other.
func (e *Events) serve(ctx context.Context, ln net.Listener) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer func() {
		stop()
		ln.Close()
		cancel()
		wg.Wait()
	}()
	slots := make(chan struct{}, maxPeers)
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors, or the like: accept again a moment later.
			e.logger.Warn("kv events: accept failed", zap.Error(err))
			if !sleep(ctx, e.cfg.Redial) {
				return
			}
			continue
		}
		select {
		case slots <- struct{}{}:
		default:
			c.Close()
			e.metrics.dropped.WithLabelValues(unknownBackend, reasonTooManyPeers).Inc()
			continue
		}
		wg.Go(func() {
			defer func() { <-slots }()
			e.peer(ctx, c)
		})
	}
}

// peer receives the messages of one connection to the listening socket until it ends or ctx
// is done. A peer at no backend's address and not allowed is closed before its handshake.
func (e *Events) peer(ctx context.Context, c net.Conn) {
	ip := remoteIP(c)
	rctx, cancel := context.WithTimeout(ctx, e.cfg.HandshakeTimeout)
	known := e.knownSource(rctx, ip)
	cancel()
	if !known {
		c.Close()
		e.metrics.dropped.WithLabelValues(unknownBackend, reasonUnknownSource).Inc()
		if ce := e.logger.Check(zap.DebugLevel, "kv events: a connection from an unknown source closed"); ce != nil {
			ce.Write(zap.Stringer("source", ip))
		}
		return
	}
	sub, bc, err := e.open(ctx, c)
	if err != nil {
		if errors.Is(err, errTooLarge) {
			e.metrics.dropped.WithLabelValues(unknownBackend, reasonTooLarge).Inc()
		}
		if ce := e.logger.Check(zap.DebugLevel, "kv events: a publisher's handshake failed"); ce != nil {
			ce.Write(zap.Stringer("source", ip), zap.Error(err))
		}
		return
	}
	e.receive(ctx, sub, c, func(frames [][]byte) ([]Endpoint, string) { return e.byTopic(ctx, frames, ip) })
	sub.Close()
	if bc.over.Load() {
		e.metrics.dropped.WithLabelValues(unknownBackend, reasonTooLarge).Inc()
	}
}

// remoteIP is c's peer's address, IPv4 as such.
func remoteIP(c net.Conn) netip.Addr {
	ap, err := netip.ParseAddrPort(c.RemoteAddr().String())
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr().Unmap().WithZone("")
}

// byTopic names the engines of a message from ip on the listening socket by its topic,
// "kv@<host:port>@<model>": only those at ip's address, unless ip is allowed. With none, the
// reason to count, if not counted already.
func (e *Events) byTopic(ctx context.Context, frames [][]byte, ip netip.Addr) ([]Endpoint, string) {
	if len(frames) == 0 {
		return nil, reasonUnknownTopic
	}
	rest, ok := strings.CutPrefix(string(frames[0]), "kv@")
	if !ok {
		return nil, reasonUnknownTopic
	}
	hostPort, _, _ := strings.Cut(rest, "@")
	e.mu.Lock()
	var eps []Endpoint
	for _, name := range e.byHost[hostPort] {
		eps = append(eps, e.endpoints[name])
	}
	e.mu.Unlock()
	if len(eps) == 0 {
		return nil, reasonUnknownTopic
	}
	if e.isAllowed(ip) {
		return eps, ""
	}
	host, _, _ := net.SplitHostPort(hostPort)
	if slices.Contains(e.hostAddrs(ctx, host), ip) {
		return eps, ""
	}
	for _, ep := range eps {
		e.metrics.dropped.WithLabelValues(ep.Engine, reasonUnknownSource).Inc()
	}
	return nil, ""
}

// SetAllowedSources replaces the sources whose messages on the listening socket are taken
// for any backend their topic names, besides each backend's own address: engines behind a NAT
// or a relay.
func (e *Events) SetAllowedSources(allowed []netip.Prefix) {
	e.mu.Lock()
	e.allowed = slices.Clone(allowed)
	e.mu.Unlock()
}

func (e *Events) isAllowed(ip netip.Addr) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, p := range e.allowed {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// knownSource reports whether ip is allowed or the address of a backend's host.
func (e *Events) knownSource(ctx context.Context, ip netip.Addr) bool {
	if e.isAllowed(ip) {
		return true
	}
	e.mu.Lock()
	hosts := e.hostsLocked()
	e.mu.Unlock()
	for h := range hosts {
		if slices.Contains(e.hostAddrs(ctx, h), ip) {
			return true
		}
	}
	return false
}

// hostsLocked is the hosts of the backends' URLs.
func (e *Events) hostsLocked() map[string]bool {
	out := make(map[string]bool, len(e.byHost))
	for hp := range e.byHost {
		if h, _, err := net.SplitHostPort(hp); err == nil {
			out[h] = true
		}
	}
	return out
}

// resolution is a host name's addresses as resolved at a time.
type resolution struct {
	addrs []netip.Addr
	at    time.Time
}

// hostAddrs returns the addresses of a backend's host: itself if it is one, else what the
// resolver answered within resolveEvery (nothing, if it failed).
func (e *Events) hostAddrs(ctx context.Context, host string) []netip.Addr {
	if a, err := netip.ParseAddr(host); err == nil {
		return []netip.Addr{a.Unmap().WithZone("")}
	}
	e.mu.Lock()
	r, ok := e.resolved[host]
	e.mu.Unlock()
	if ok && e.now().Sub(r.at) < resolveEvery {
		return r.addrs
	}
	ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil && ctx.Err() != nil {
		return nil // ended, not answered: nothing to remember
	}
	for i, a := range addrs {
		addrs[i] = a.Unmap().WithZone("")
	}
	e.mu.Lock()
	if e.hostsLocked()[host] { // still a backend's: the cache holds those only
		e.resolved[host] = resolution{addrs: addrs, at: e.now()}
	}
	e.mu.Unlock()
	return addrs
}

// receive applies the messages sub reads from its one connection c until c ends; ctx's end
// ends it by closing c. zmq4's reader queues up to 10 messages ahead and then blocks on the
// next, past the socket's Close, with the message it holds (up to maxMessage bytes): so the
// socket is read to its connection's error, the last thing its reader sends, and only then
// closed by the caller. Messages read after ctx ended are dropped.
func (e *Events) receive(ctx context.Context, sub zmq4.Socket, c net.Conn, who func([][]byte) ([]Endpoint, string)) {
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	var dec Decoder // each message is applied before the next is decoded
	for {
		msg, err := sub.Recv()
		if err != nil {
			if ctx.Err() == nil {
				if ce := e.logger.Check(zap.DebugLevel, "kv events: a publisher's connection ended"); ce != nil {
					ce.Write(zap.Error(err))
				}
			}
			return
		}
		if ctx.Err() != nil {
			continue
		}
		eps, reason := who(msg.Frames)
		if len(eps) == 0 {
			if reason != "" {
				e.metrics.dropped.WithLabelValues(unknownBackend, reason).Inc()
			}
			continue
		}
		for _, ep := range eps {
			e.handle(ctx, &dec, ep, msg.Frames)
		}
	}
}

// handle applies one message of ep's engine, in sequence, decoded by dec.
func (e *Events) handle(ctx context.Context, dec *Decoder, ep Endpoint, frames [][]byte) {
	m, err := dec.DecodeMessage(frames)
	if err != nil {
		reason := ReasonDecode
		var de *DecodeError
		if errors.As(err, &de) {
			reason = de.Reason
		}
		e.metrics.dropped.WithLabelValues(ep.Engine, reason).Inc()
		if ce := e.logger.Check(zap.DebugLevel, "kv events: message dropped"); ce != nil {
			ce.Write(zap.String("backend", ep.Engine), zap.Error(err))
		}
		return
	}
	key := streamKey{ep.Engine, m.Batch.Rank}
	e.mu.Lock()
	if _, ok := e.endpoints[ep.Engine]; !ok {
		e.mu.Unlock()
		return // removed while the message was on its way
	}
	st, seen := e.streams[key]
	if !seen {
		st = &stream{}
		e.streams[key] = st
	}
	last := st.last
	e.mu.Unlock()

	switch {
	case !seen:
		if m.Seq > 0 && ep.Replay != "" {
			e.catchUp(ctx, ep, m.Seq)
		}
	case m.Seq == last+1:
	case m.Seq <= last:
		// The engine restarted (its sequence starts again at 0, or 1 for some simulators):
		// nothing it held survived.
		e.reset(ep.Engine, "sequence_reset")
	default:
		e.fill(ctx, ep, last+1, m.Seq)
	}
	e.apply(ep.Engine, &m.Batch)
	e.mu.Lock()
	st.last = m.Seq
	e.mu.Unlock()
	e.index.Touch(ep.Engine, e.now())
}

// fill recovers the batches from..until-1 that were lost, by replay where the engine has a
// replay endpoint; if that is impossible, the engine is forgotten rather than half known.
func (e *Events) fill(ctx context.Context, ep Endpoint, from, until uint64) {
	if ep.Replay == "" || until-from > maxReplay {
		e.reset(ep.Engine, "gap")
		return
	}
	batches, err := e.replay(ctx, ep.Replay, from, until, false)
	if err != nil {
		e.metrics.replays.WithLabelValues(ep.Engine, "failed").Inc()
		e.logger.Warn("kv events: replay failed; the engine's cache is forgotten until new events",
			zap.String("backend", ep.Engine), zap.Uint64("from", from), zap.Uint64("until", until), zap.Error(err))
		e.reset(ep.Engine, "gap")
		return
	}
	e.metrics.replays.WithLabelValues(ep.Engine, "ok").Inc()
	for i := range batches {
		e.apply(ep.Engine, &batches[i])
	}
}

// catchUp asks the replay endpoint for what the engine published before the first message
// seen: the blocks it stored while the proxy was not listening (a proxy restarted or scaled
// out) are in the engine's replay buffer. Whatever part of it comes back helps; a failure
// only leaves the engine as little known as it was.
func (e *Events) catchUp(ctx context.Context, ep Endpoint, until uint64) {
	from := uint64(0)
	if until > maxReplay {
		from = until - maxReplay
	}
	batches, err := e.replay(ctx, ep.Replay, from, until, true)
	if err != nil {
		e.metrics.replays.WithLabelValues(ep.Engine, "failed").Inc()
		if ce := e.logger.Check(zap.DebugLevel, "kv events: catching up by replay failed"); ce != nil {
			ce.Write(zap.String("backend", ep.Engine), zap.Error(err))
		}
		return
	}
	e.metrics.replays.WithLabelValues(ep.Engine, "ok").Inc()
	for i := range batches {
		e.apply(ep.Engine, &batches[i])
	}
}

// endSeq is the replay's end marker's sequence: -1 as 8 bytes.
const endSeq = ^uint64(0)

// replay asks a replay endpoint for the batches from..until-1: a DEALER sends [empty, start
// sequence] to the engine's ROUTER, which answers [empty, sequence, payload] per batch it
// still has from there, then [empty, -1, empty]. With partial, the answer may start later
// and end earlier (the engine's buffer no longer has the oldest), but has no hole.
func (e *Events) replay(ctx context.Context, endpoint string, from, until uint64, partial bool) ([]Batch, error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(ctx, e.zlog, zmq4.WithDialerMaxRetries(0), zmq4.WithTimeout(e.cfg.ReplayTimeout),
		zmq4.WithDialerTimeout(e.cfg.ReplayTimeout))
	defer d.Close()
	if err := d.Dial(bounded(endpoint)); err != nil {
		return nil, err
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], from)
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, start[:])); err != nil {
		return nil, fmt.Errorf("send replay request: %w", err)
	}
	var out []Batch
	next := from
	for next < until {
		msg, err := d.Recv()
		if err != nil {
			return nil, fmt.Errorf("receive replay: %w", err)
		}
		frames := msg.Frames
		if len(frames) > 2 && len(frames[0]) == 0 {
			frames = frames[1:] // the ROUTER's empty delimiter
		}
		if len(frames) == 3 && len(frames[1]) == 8 {
			frames = frames[1:] // a topic before the sequence, as a published message has
		}
		if len(frames) != 2 || len(frames[0]) != 8 {
			return nil, fmt.Errorf("replay answer of %d frames", len(msg.Frames))
		}
		seq := binary.BigEndian.Uint64(frames[0])
		switch {
		case seq == endSeq && partial:
			return out, nil
		case seq == endSeq:
			return nil, fmt.Errorf("replay ended at %d, before %d: the engine no longer has the rest", next, until)
		case seq < next:
			continue
		case seq >= until && partial:
			return out, nil
		case seq > next && partial && len(out) == 0:
			next = seq // the buffer starts later than asked
		case seq > next:
			return nil, fmt.Errorf("replay jumps to %d, not %d: the engine no longer has the rest", seq, next)
		}
		b, err := DecodeBatch(frames[1])
		if err != nil {
			return nil, fmt.Errorf("replayed batch %d: %w", seq, err)
		}
		out = append(out, b)
		next++
	}
	// The batches after until-1 arrived on the SUB socket; the rest of the answer is left
	// with the dealer, closed now.
	return out, nil
}

// reset forgets the engine, for why.
func (e *Events) reset(engine, why string) {
	e.index.Forget(engine)
	e.metrics.resets.WithLabelValues(engine, why).Inc()
	if ce := e.logger.Check(zap.InfoLevel, "kv events: engine's cache forgotten"); ce != nil {
		ce.Write(zap.String("backend", engine), zap.String("reason", why))
	}
}

func (e *Events) apply(engine string, b *Batch) {
	for i := range b.Events {
		ev := &b.Events[i]
		e.metrics.events.WithLabelValues(engine, ev.Kind.String()).Inc()
		if why := e.index.Apply(engine, ev); why != "" {
			e.metrics.dropped.WithLabelValues(engine, why).Inc()
		}
		if ev.Kind == AllBlocksCleared {
			e.metrics.resets.WithLabelValues(engine, "cleared").Inc()
		}
	}
	if b.Unknown > 0 {
		e.metrics.dropped.WithLabelValues(engine, "unknown_tag").Add(float64(b.Unknown))
	}
	if b.Malformed > 0 {
		e.metrics.dropped.WithLabelValues(engine, "malformed").Add(float64(b.Malformed))
	}
}

// sleep waits d or until ctx is done; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
