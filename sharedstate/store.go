// Package sharedstate owns what the proxy's replicas share and their engines cannot report:
// each client key's rate and concurrency limits, the engines each session is bound to, the
// engines the heads of prompts were last sent to and the uncached tokens each engine was sent
// lately (Placements), for the cache-aware routing.
// It lives in Redis (or Valkey); a Store is one replica's view of it.
//
// On a request's path a Store makes two round trips at most, each bounded by a budget of a
// few milliseconds: one script decides the key's limits and reads the session's bindings, and
// one pipeline reads the placements and counts of both pools before the first pick (only for
// a prompt with a head, on a cache-aware pool). What can wait (a slot given back, a session
// bound, a placement, the tokens sent, the slots' refresh) goes through a bounded queue to one
// goroutine, off the path. When Redis fails or is slow, every call says so at
// once and the caller decides on its own state; the Store stops asking Redis for a short
// back-off, logs the outage once, and when Redis answers again logs that once and puts back
// the slots of the requests still in flight.
package sharedstate

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/logging"
	"github.com/redis/go-redis/v9/maintnotifications"
	"go.uber.org/zap"
)

// The operations of a Store: the op label of its metrics.
const (
	opCheck   = "check"
	opRelease = "release"
	opBind    = "bind"
	opRefresh = "refresh"
	opFlows   = "flows"
	// opPlacements reads where the replicas placed a prompt's heads; opPlace writes one.
	opPlacements = "placements"
	opPlace      = "place"
	// opSent adds the uncached tokens a replica sent an engine (AddSent).
	opSent = "sent"
)

// Reasons a Check refuses a request.
const (
	ReasonRate        = "rate"
	ReasonConcurrency = "concurrency"
)

const (
	// backgroundTimeout bounds a call off the request path (the queue's, the refresh, the
	// probe), and a connection's dial.
	backgroundTimeout = time.Second
	// queueSize bounds the operations waiting for the goroutine; one more is dropped.
	queueSize = 4096
	// batchSize is how many operations go in one pipeline, and slots in one refresh call.
	batchSize = 256
	// maxSessionKeys bounds the sessions one Check reads; the rest are not read.
	maxSessionKeys = 8
	// maxSlots bounds the slots a Store keeps for its requests in flight: a Check that would
	// take one more answers ErrTooManySlots.
	maxSlots = 1 << 20
	// maxHeldReleases bounds the releases kept, while Redis is down, to send when it is back.
	maxHeldReleases = 1 << 16
	// The back-off after a failure: the first probe this long after it, doubling while Redis
	// stays down, to at most maxBackoff.
	minBackoff = 100 * time.Millisecond
	maxBackoff = 2 * time.Second
	// maxBindingBytes bounds a binding's role and engine name.
	maxBindingBytes = 256
)

var (
	// ErrUnavailable is Check's answer while the Store is backing off after a failure.
	ErrUnavailable = errors.New("shared state: redis unavailable, backing off")
	// ErrTooManySlots is Check's answer when the Store holds maxSlots slots already.
	ErrTooManySlots = errors.New("shared state: too many slots in flight")
)

// quietRedis silences go-redis's own logger, which is the process's (it has no other): it
// writes a line to stderr for every dial that fails, so an outage would fill the log with
// them. A Store says what matters itself, once: the outage, and its end.
var quietRedis sync.Once

// Request is what Check decides: one request of a key, under the key's limits.
type Request struct {
	// Key names the limits' owner (a client's identity); any string, hashed before use.
	Key string
	// Rate is the key's requests per second; 0 means no rate limit.
	Rate float64
	// Burst is how many requests may come at once after a quiet spell; at least 1 with a
	// Rate.
	Burst int
	// MaxConcurrent bounds the key's requests in flight across replicas; 0 means no bound.
	MaxConcurrent int
	// SessionKeys are sessions whose bindings the answer carries (the first 8); any strings,
	// hashed before use. None means none are read.
	SessionKeys []string
}

// Decision is Check's answer.
type Decision struct {
	// Allowed says the request is let in.
	Allowed bool
	// Reason is why it is not: ReasonRate or ReasonConcurrency; empty when allowed.
	Reason string
	// RetryAfter is when the request would be let in: for a rate, when its turn comes; for
	// concurrency a second, as nothing tells when a slot ends.
	RetryAfter time.Duration
	// Slot is the request's concurrency slot: Release it when the request ends. Zero when no
	// slot was taken.
	Slot Slot
	// Bindings are the engines the request's sessions are bound to, by session and role;
	// sessions with none are absent.
	Bindings map[string]map[string]string
}

// Slot is one request's concurrency slot. Its zero value is no slot.
type Slot struct{ id uint64 }

// slot is a slot the Store refreshes until it is released.
type slot struct {
	set, member string
	// sent says Redis may hold it: a check or a refresh that carried it went out. One
	// that never went out (taken while Redis was down) needs no release there.
	sent bool
}

// op is an operation for the goroutine: a slot's release, a session's binding or a prompt
// head's placement.
type op struct {
	kind        string // opRelease, opBind, opPlace or opSent
	key, member string // the slot set and member; or the session hash and role; or the head's key; or the window's hash and the engine
	engine      string
	n           int64 // opSent's tokens
	ttl         time.Duration
}

// Store is one replica's handle on the shared state. Check is safe for concurrent use; Run
// runs the goroutine that Release, Bind and the slots' refresh need.
type Store struct {
	cfg     Config
	timeout time.Duration
	rdb     *redis.Client
	logger  *zap.Logger
	m       *metrics
	// replica starts this Store's slot members, so that no two replicas' slots collide.
	replica string
	seq     atomic.Uint64

	ops chan op
	// down is set by a failure and cleared by the goroutine's probe; while set no call goes
	// to Redis. failed wakes the goroutine to start probing.
	down      atomic.Bool
	downSince atomic.Int64 // unix nanoseconds
	failed    chan struct{}

	mu    sync.Mutex
	slots map[uint64]slot
}

// New makes a Store for cfg, which must be Enabled. It connects lazily: an unreachable
// server makes the first calls fail (and the Store back off), not New.
func New(cfg Config, logger *zap.Logger, reg prometheus.Registerer) (*Store, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return nil, err
	}
	if !cfg.Enabled() {
		return nil, errors.New("shared_state.redis.addr: required")
	}
	password, err := cfg.Redis.password()
	if err != nil {
		return nil, err
	}
	quietRedis.Do(func() { redis.SetLogger(&logging.VoidLogger{}) })
	var id [8]byte
	rand.Read(id[:])
	opt := &redis.Options{
		Addr:     cfg.Redis.Addr,
		Username: cfg.Redis.Username,
		Password: password,
		DB:       cfg.Redis.DB,
		// RESP2 and no CLIENT SETINFO: a new connection costs its dial, AUTH and SELECT only,
		// which matters when one is dialled within a request's budget.
		Protocol:                 2,
		DisableIdentity:          true,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
		// Every call carries its own deadline (the budget, or backgroundTimeout); a retry
		// would not fit in the budget, and the next refresh is the retry of a refresh.
		ContextTimeoutEnabled: true,
		MaxRetries:            -1,
		DialerRetries:         1,
		DialTimeout:           backgroundTimeout,
		ReadTimeout:           backgroundTimeout,
		WriteTimeout:          backgroundTimeout,
		PoolTimeout:           backgroundTimeout,
	}
	if cfg.Redis.TLS {
		host, _, _ := net.SplitHostPort(cfg.Redis.Addr)
		opt.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12, ServerName: host}
	}
	s := &Store{
		cfg: cfg, timeout: *cfg.Redis.Timeout, rdb: redis.NewClient(opt), logger: logger, m: newMetrics(reg),
		replica: hex.EncodeToString(id[:]), ops: make(chan op, queueSize), failed: make(chan struct{}, 1),
		slots: make(map[uint64]slot),
	}
	s.m.up.Set(1) // until a call fails
	return s, nil
}

// Close closes the connections to Redis. The slots still held stay there until their TTL:
// call it after Run has returned, once the requests have ended.
func (s *Store) Close() error { return s.rdb.Close() }

// key is Redis's name for a client-chosen string of a kind: the prefix, the kind and a hash,
// so that nothing a client sends sizes a key or reaches Redis as written.
func (s *Store) key(kind, name string) string { return s.hashedKey(kind, hash(name)) }

func (s *Store) hashedKey(kind, h string) string { return s.cfg.Redis.KeyPrefix + kind + ":" + h }

func hash(name string) string {
	h := sha256.Sum256([]byte(name))
	return hex.EncodeToString(h[:16])
}

// Check decides req in one round trip at most, within the budget. On an error (Redis failed,
// timed out, or the Store is backing off) the caller decides on its own: the Decision's Slot
// is then still the request's, kept here and put in Redis when it is back, so that the
// request counts there while it runs. Release a Decision's Slot whatever Check returned.
func (s *Store) Check(ctx context.Context, req Request) (Decision, error) {
	sessions := req.SessionKeys
	if len(sessions) > maxSessionKeys {
		sessions = sessions[:maxSessionKeys]
	}
	rate := req.Rate > 0 && !math.IsInf(req.Rate, 0)
	if !rate && req.MaxConcurrent <= 0 && len(sessions) == 0 {
		return Decision{Allowed: true}, nil
	}
	h := hash(req.Key)
	set := s.hashedKey("slots", h)
	var id uint64
	if req.MaxConcurrent > 0 {
		id = s.seq.Add(1)
	}
	member := ""
	if id != 0 {
		member = s.replica + ":" + strconv.FormatUint(id, 36)
	}
	if s.down.Load() {
		s.m.errors.WithLabelValues(opCheck).Inc()
		return s.undecided(id, set, member, false, ErrUnavailable)
	}
	var interval int64
	burst := 1
	if rate {
		interval = max(int64(math.Round(1e6/req.Rate)), 1)
		burst = max(req.Burst, 1)
	}
	keys := make([]string, 0, 2+len(sessions))
	keys = append(keys, s.hashedKey("rate", h), set)
	for _, k := range sessions {
		keys = append(keys, s.key("session", k))
	}
	cctx, cancel := context.WithTimeout(ctx, s.timeout)
	start := time.Now()
	res, err := checkScript.Run(cctx, s.rdb, keys, interval, burst, max(req.MaxConcurrent, 0), member, s.cfg.SlotTTL.Milliseconds()).Slice()
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			// The caller gave up: no news of Redis. The script may have run, so the slot is
			// kept for the caller to release all the same.
			return s.undecided(id, set, member, true, ctx.Err())
		}
		s.fail(opCheck, err)
		return s.undecided(id, set, member, true, fmt.Errorf("shared state: check: %w", err))
	}
	s.m.checkSeconds.Observe(time.Since(start).Seconds())
	d, err := decision(res, sessions)
	if err != nil {
		s.fail(opCheck, err)
		return s.undecided(id, set, member, true, err)
	}
	if d.Allowed && id != 0 {
		if d.Slot, err = s.track(id, set, member, true); err != nil {
			// The slot went in, and this replica cannot keep it.
			s.enqueue(op{kind: opRelease, key: set, member: member})
			return Decision{}, err
		}
	}
	return d, nil
}

// undecided is Check's answer when Redis did not decide: the slot the request would have
// (when it asked for one), kept for the reconcile; sent says the check went out.
func (s *Store) undecided(id uint64, set, member string, sent bool, err error) (Decision, error) {
	if id == 0 {
		return Decision{}, err
	}
	sl, terr := s.track(id, set, member, sent)
	if terr != nil {
		return Decision{}, errors.Join(err, terr)
	}
	return Decision{Slot: sl}, err
}

func (s *Store) track(id uint64, set, member string, sent bool) (Slot, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.slots) >= maxSlots {
		return Slot{}, ErrTooManySlots
	}
	s.slots[id] = slot{set: set, member: member, sent: sent}
	s.m.slots.Set(float64(len(s.slots)))
	return Slot{id: id}, nil
}

// decision reads the check script's answer. An answer of another shape than the script's (a
// string where it returns an integer, a reason it never gives, an odd list of fields) is an
// error like an unreachable server's: the caller decides on its own limits, never refusing
// a request on a value it could not read.
func decision(res []any, sessions []string) (Decision, error) {
	if len(res) != 4 {
		return Decision{}, fmt.Errorf("shared state: check answered %d values, want 4", len(res))
	}
	allowed, ok := res[0].(int64)
	if !ok || (allowed != 0 && allowed != 1) {
		return Decision{}, fmt.Errorf("shared state: check answered %T %v for allowed, want the integer 0 or 1", res[0], res[0])
	}
	reason, ok := res[1].(string)
	if !ok {
		return Decision{}, fmt.Errorf("shared state: check answered %T for the reason, want a string", res[1])
	}
	retryUS, ok := res[2].(int64)
	if !ok || retryUS < 0 {
		return Decision{}, fmt.Errorf("shared state: check answered %T %v for the retry delay, want an integer of microseconds", res[2], res[2])
	}
	d := Decision{Allowed: allowed == 1, Reason: reason}
	switch {
	case d.Allowed && reason == "":
	case !d.Allowed && reason == ReasonRate:
		d.RetryAfter = time.Duration(retryUS) * time.Microsecond
	case !d.Allowed && reason == ReasonConcurrency:
		d.RetryAfter = time.Second
	default:
		return Decision{}, fmt.Errorf("shared state: check answered allowed %d with reason %q", allowed, reason)
	}
	lists, ok := res[3].([]any)
	if !ok || len(lists) != len(sessions) {
		return Decision{}, fmt.Errorf("shared state: check answered %T for the sessions' bindings, want a list of %d", res[3], len(sessions))
	}
	for i, l := range lists {
		fields, ok := l.([]any)
		if !ok || len(fields)%2 != 0 {
			return Decision{}, fmt.Errorf("shared state: check answered %T for session %d's binding, want a list of role and engine pairs", l, i)
		}
		if len(fields) == 0 {
			continue
		}
		roles := make(map[string]string, len(fields)/2)
		for j := 0; j+1 < len(fields); j += 2 {
			role, ok1 := fields[j].(string)
			engine, ok2 := fields[j+1].(string)
			if !ok1 || !ok2 {
				return Decision{}, fmt.Errorf("shared state: check answered %T and %T in session %d's binding, want strings", fields[j], fields[j+1], i)
			}
			roles[role] = engine
		}
		if d.Bindings == nil {
			d.Bindings = make(map[string]map[string]string, len(sessions))
		}
		d.Bindings[sessions[i]] = roles
	}
	return d, nil
}

// Release gives a request's slot back, off the request path; the zero Slot is no slot. A
// release the queue cannot take is dropped and counted: the slot then ends at its TTL.
func (s *Store) Release(sl Slot) {
	if sl.id == 0 {
		return
	}
	s.mu.Lock()
	e, ok := s.slots[sl.id]
	delete(s.slots, sl.id)
	s.m.slots.Set(float64(len(s.slots)))
	s.mu.Unlock()
	if ok && e.sent {
		s.enqueue(op{kind: opRelease, key: e.set, member: e.member})
	}
}

// Bind records, off the request path, that session's requests of role go to engine, for ttl
// from now (each Bind starts it again). A binding the queue cannot take is dropped and
// counted.
func (s *Store) Bind(session, role, engine string, ttl time.Duration) {
	if session == "" || role == "" || engine == "" || ttl <= 0 || len(role) > maxBindingBytes || len(engine) > maxBindingBytes {
		return
	}
	s.enqueue(op{kind: opBind, key: s.key("session", session), member: role, engine: engine, ttl: ttl})
}

func (s *Store) enqueue(o op) {
	select {
	case s.ops <- o:
	default:
		s.m.dropped.WithLabelValues(o.kind).Inc()
	}
}

// fail counts a call of kind that failed, and starts the back-off.
func (s *Store) fail(kind string, err error) {
	s.m.errors.WithLabelValues(kind).Inc()
	s.markDown(kind, err)
}

// markDown starts the back-off the first time after Redis answered: the outage is logged
// once, and the goroutine probes until Redis answers again.
func (s *Store) markDown(kind string, err error) {
	if !s.down.CompareAndSwap(false, true) {
		return
	}
	s.downSince.Store(time.Now().UnixNano())
	s.m.up.Set(0)
	s.logger.Warn("shared state unreachable: each replica decides on its own state until it is back",
		zap.String("addr", s.cfg.Redis.Addr), zap.String("op", kind), zap.Error(err))
	select {
	case s.failed <- struct{}{}:
	default:
	}
}

// Run sends the queue's operations and refreshes the slots every third of their TTL until
// ctx ends; then it sends what is still queued, within backgroundTimeout, and returns nil.
// While Redis is down it probes it, after a back-off that doubles from 100ms to 2s.
func (s *Store) Run(ctx context.Context) error {
	refresh := time.NewTicker(s.cfg.SlotTTL / 3)
	defer refresh.Stop()
	// The first probe at once: it loads the scripts, and finds an unreachable Redis before
	// a request does.
	probe := time.NewTimer(0)
	defer probe.Stop()
	backoff := time.Duration(0) // 0: not backing off
	// held are releases that could not be sent, for when Redis is back.
	var held []op
	hold := func(batch []op) {
		for _, o := range batch {
			s.m.errors.WithLabelValues(o.kind).Inc()
			if o.kind != opRelease {
				continue // a binding or a placement is redone by the next request
			}
			if len(held) >= maxHeldReleases {
				s.m.dropped.WithLabelValues(o.kind).Inc()
				continue
			}
			held = append(held, o)
		}
	}
	for {
		select {
		case <-ctx.Done():
			s.flush(append(held, s.drainAll()...))
			return nil
		case o := <-s.ops:
			batch := s.drain(o)
			if s.down.Load() {
				hold(batch)
				continue
			}
			if err := s.send(ctx, batch); err != nil {
				hold(batch)
				s.markDown(batch[0].kind, err)
			}
		case <-refresh.C:
			if s.down.Load() {
				continue // the reconcile refreshes
			}
			if err := s.refresh(ctx); err != nil {
				s.fail(opRefresh, err)
			}
		case <-s.failed:
			if backoff == 0 {
				backoff = minBackoff
				probe.Reset(backoff)
			}
		case <-probe.C:
			if err := s.reconcile(ctx, held); err != nil {
				s.markDown("probe", err)
				backoff = min(max(2*backoff, minBackoff), maxBackoff)
				probe.Reset(backoff)
				continue
			}
			held = nil
			backoff = 0
			if s.down.Load() {
				s.up()
			}
		}
	}
}

// drain takes, after o, what else is queued, up to a batch.
func (s *Store) drain(o op) []op {
	batch := []op{o}
	for len(batch) < batchSize {
		select {
		case o := <-s.ops:
			batch = append(batch, o)
		default:
			return batch
		}
	}
	return batch
}

// drainAll takes what is queued.
func (s *Store) drainAll() []op {
	var all []op
	for {
		select {
		case o := <-s.ops:
			all = append(all, o)
		default:
			return all
		}
	}
}

// send pipelines a batch of operations.
func (s *Store) send(ctx context.Context, batch []op) error {
	ctx, cancel := context.WithTimeout(ctx, backgroundTimeout)
	defer cancel()
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, o := range batch {
			switch o.kind {
			case opRelease:
				p.ZRem(ctx, o.key, o.member)
			case opBind:
				p.HSet(ctx, o.key, o.member, o.engine)
				p.PExpire(ctx, o.key, o.ttl)
			case opPlace:
				p.Set(ctx, o.key, o.engine, o.ttl)
			case opSent:
				p.HIncrBy(ctx, o.key, o.member, o.n)
				p.PExpire(ctx, o.key, o.ttl)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("shared state: %s: %w", batch[0].kind, err)
	}
	return nil
}

// refresh moves every slot's expiry a TTL on, putting back the ones Redis lost.
func (s *Store) refresh(ctx context.Context) error {
	s.mu.Lock()
	all := make([]slot, 0, len(s.slots))
	for id, sl := range s.slots {
		// Sent from now: a release from here on goes to the queue, and so to Redis after
		// this refresh, which this goroutine finishes first.
		sl.sent = true
		s.slots[id] = sl
		all = append(all, sl)
	}
	s.mu.Unlock()
	for len(all) > 0 {
		n := min(len(all), batchSize)
		keys := make([]string, n)
		args := make([]any, n+1)
		args[0] = s.cfg.SlotTTL.Milliseconds()
		for i, sl := range all[:n] {
			keys[i], args[i+1] = sl.set, sl.member
		}
		cctx, cancel := context.WithTimeout(ctx, backgroundTimeout)
		err := refreshScript.Run(cctx, s.rdb, keys, args...).Err()
		cancel()
		if err != nil {
			return fmt.Errorf("shared state: refresh: %w", err)
		}
		all = all[n:]
	}
	return nil
}

// reconcile is the probe: Redis answers, has the scripts, is given the releases held while
// it was down, and holds the slots of the requests still in flight.
func (s *Store) reconcile(ctx context.Context, held []op) error {
	cctx, cancel := context.WithTimeout(ctx, backgroundTimeout)
	defer cancel()
	if err := s.rdb.Ping(cctx).Err(); err != nil {
		return fmt.Errorf("shared state: ping: %w", err)
	}
	for _, sc := range []*redis.Script{checkScript, refreshScript} {
		if err := sc.Load(cctx, s.rdb).Err(); err != nil {
			return fmt.Errorf("shared state: load script: %w", err)
		}
	}
	for len(held) > 0 {
		n := min(len(held), batchSize)
		if err := s.send(ctx, held[:n]); err != nil {
			return err
		}
		held = held[n:]
	}
	return s.refresh(ctx)
}

// up ends the back-off after an outage, and logs it.
func (s *Store) up() {
	s.down.Store(false)
	s.m.up.Set(1)
	s.logger.Info("shared state reachable again", zap.String("addr", s.cfg.Redis.Addr),
		zap.Duration("down_for", time.Since(time.Unix(0, s.downSince.Load()))))
}

// flush sends, at shutdown, the operations left: the slots of requests that ended go back
// now rather than at their TTL. Nothing is tried while Redis is down.
func (s *Store) flush(batch []op) {
	for len(batch) > 0 && !s.down.Load() {
		n := min(len(batch), batchSize)
		ctx, cancel := context.WithTimeout(context.Background(), backgroundTimeout)
		err := s.send(ctx, batch[:n])
		cancel()
		if err != nil {
			for _, o := range batch {
				s.m.errors.WithLabelValues(o.kind).Inc()
			}
			return
		}
		batch = batch[n:]
	}
}
