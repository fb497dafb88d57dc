package sharedstate

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxPlacementKeys bounds the heads one Placements call reads (both pools' 3 heads of fixed
// lengths and 5 turns' ends); the rest are not read.
const maxPlacementKeys = 16

// Head names one head of a prompt in one pool: the pool's role, and the head's key, an opaque
// string hashed before use.
type Head struct {
	Role, Key string
}

// headKey is the head's Redis key.
func (s *Store) headKey(h Head) string { return s.key("head", h.Role+"\x00"+h.Key) }

// Sent names an engine in one pool whose recent work a pick weighs: the uncached prompt
// tokens every replica sent it lately (AddSent).
type Sent struct {
	Role, Engine string
}

// maxSentEngines bounds the engines one Placements call reads the work of; the rest read as 0.
const maxSentEngines = 16

// sentWindow is the width of the windows the replicas count the tokens they sent each engine
// in: a read weighs the current window whole and the one before it by how much of it is
// still within sentWindow of now.
const sentWindow = 30 * time.Second

// Placements answers which engine the replicas last sent each of heads to ("" for a head no
// replica placed within its TTL), and how many uncached prompt tokens every replica sent
// each of engines within about the last 30 s (AddSent), whatever their roles, in one round
// trip within the budget. It reads the first 16 heads and the first 16 engines. While Redis
// is down it answers ErrUnavailable at once: the replica then weighs what it routed alone.
func (s *Store) Placements(ctx context.Context, heads []Head, engines []Sent) (placed []string, sent []float64, err error) {
	heads = heads[:min(len(heads), maxPlacementKeys)]
	engines = engines[:min(len(engines), maxSentEngines)]
	if len(heads) == 0 && len(engines) == 0 {
		return nil, nil, nil
	}
	if s.down.Load() {
		s.m.errors.WithLabelValues(opPlacements).Inc()
		return nil, nil, ErrUnavailable
	}
	now := time.Now()
	window := now.UnixNano() / int64(sentWindow)
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	var headsCmd *redis.SliceCmd
	type sentRead struct {
		at         []int // indexes into engines
		cur, prior *redis.SliceCmd
	}
	byRole := map[string]*sentRead{}
	_, err = s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		if len(heads) > 0 {
			names := make([]string, len(heads))
			for i, h := range heads {
				names[i] = s.headKey(h)
			}
			headsCmd = p.MGet(ctx, names...)
		}
		var roles []string
		for i, e := range engines {
			r := byRole[e.Role]
			if r == nil {
				r = &sentRead{}
				byRole[e.Role] = r
				roles = append(roles, e.Role)
			}
			r.at = append(r.at, i)
		}
		for _, role := range roles {
			r := byRole[role]
			fields := make([]string, len(r.at))
			for k, i := range r.at {
				fields[k] = engines[i].Engine
			}
			r.cur = p.HMGet(ctx, s.sentKey(role, window), fields...)
			r.prior = p.HMGet(ctx, s.sentKey(role, window-1), fields...)
		}
		return nil
	})
	if err != nil {
		if ctx.Err() != nil && context.Cause(ctx) != context.DeadlineExceeded {
			return nil, nil, ctx.Err() // the caller gave up: no news of Redis
		}
		s.fail(opPlacements, err)
		return nil, nil, fmt.Errorf("shared state: placements: %w", err)
	}
	placed = make([]string, len(heads))
	if headsCmd != nil {
		for i, v := range headsCmd.Val() {
			if str, ok := v.(string); ok && i < len(placed) && len(str) <= maxBindingBytes {
				placed[i] = str
			}
		}
	}
	// The window before counts for the part of it still within sentWindow of now.
	into := float64(now.UnixNano()%int64(sentWindow)) / float64(sentWindow)
	sent = make([]float64, len(engines))
	for _, r := range byRole {
		cur, prior := r.cur.Val(), r.prior.Val()
		for k, i := range r.at {
			sent[i] = tokensOf(cur, k) + (1-into)*tokensOf(prior, k)
		}
	}
	return placed, sent, nil
}

// tokensOf is the count at k of an HMGET's answer, 0 where absent or not a count.
func tokensOf(vals []any, k int) float64 {
	if k >= len(vals) {
		return 0
	}
	str, ok := vals[k].(string)
	if !ok {
		return 0
	}
	n, err := strconv.ParseInt(str, 10, 64)
	if err != nil || n < 0 {
		return 0
	}
	return float64(n)
}

// sentKey is the Redis hash of the tokens the replicas sent each engine of role's pool in
// window (a count of sentWindows since the epoch).
func (s *Store) sentKey(role string, window int64) string {
	return s.key("sent", role+"\x00"+strconv.FormatInt(window, 10))
}

// AddSent records, off the request path, that a replica sent engine, in role's pool, a
// request of tokens uncached prompt tokens. One the queue cannot take is dropped and counted.
func (s *Store) AddSent(role, engine string, tokens float64) {
	n := int64(math.Round(tokens))
	if role == "" || engine == "" || n <= 0 || len(engine) > maxBindingBytes {
		return
	}
	window := time.Now().UnixNano() / int64(sentWindow)
	s.enqueue(op{kind: opSent, key: s.sentKey(role, window), member: engine, n: n, ttl: 3 * sentWindow})
}

// Place records, off the request path, that head went to engine, for ttl from now (each Place
// starts it again, and the latest engine wins). One the queue cannot take is dropped and
// counted: the head's next request places it again.
func (s *Store) Place(h Head, engine string, ttl time.Duration) {
	if h.Key == "" || h.Role == "" || engine == "" || ttl <= 0 || len(engine) > maxBindingBytes {
		return
	}
	s.enqueue(op{kind: opPlace, key: s.headKey(h), engine: engine, ttl: ttl})
}
