package sharedstate

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"
)

const (
	// DefaultTimeout is the budget of one call on a request's path.
	DefaultTimeout = 5 * time.Millisecond
	// MaxTimeout bounds the budget: every request may wait this long for Redis, and a budget
	// longer than a backend's own latency would make Redis the slowest part of the proxy.
	MaxTimeout = 100 * time.Millisecond
	// DefaultSlotTTL is how long a slot outlives the replica that stopped refreshing it.
	DefaultSlotTTL = 30 * time.Second
	// minSlotTTL keeps the refresh (every third of it) from becoming a load of its own, and
	// leaves a refresh that waits its full background timeout time to land.
	minSlotTTL = 3 * time.Second
	// DefaultKeyPrefix starts every key the proxy writes.
	DefaultKeyPrefix = "pdproxy:"
	maxKeyPrefix     = 64
)

// Config is where the replicas keep what their engines cannot report. Its zero value means
// none: each replica works alone.
type Config struct {
	// Redis is the server (or Valkey) the replicas share. Empty means no shared state.
	Redis RedisConfig `yaml:"redis"`
	// SlotTTL is how long a concurrency slot lives in Redis unless its replica refreshes it
	// (every third of it, while the request runs): the longest a replica that died holds its
	// slots. [DefaultSlotTTL]; below 3s is refused.
	SlotTTL time.Duration `yaml:"slot_ttl"`
}

// RedisConfig is how to reach the Redis server. A single server (or a primary behind one
// address): one script reads a key's limits and its session's bindings together, which a
// Redis Cluster would refuse for keys of different hash slots.
type RedisConfig struct {
	// Addr is the server's host:port. Required with any other key of shared_state.
	Addr string `yaml:"addr"`
	// Username is the ACL user; empty means the default user.
	Username string `yaml:"username"`
	// PasswordFile is a file holding the password (trailing whitespace trimmed), read at
	// startup; empty means none.
	PasswordFile string `yaml:"password_file"`
	// DB is the database number. [0]
	DB int `yaml:"db"`
	// TLS connects over TLS, verifying the server's certificate against the system's roots.
	TLS bool `yaml:"tls"`
	// Timeout is the budget of one call on a request's path: a request waits at most this
	// long for Redis before its replica decides on local state alone. [DefaultTimeout]; 0,
	// negative or above MaxTimeout is refused.
	Timeout *time.Duration `yaml:"timeout"`
	// KeyPrefix starts every key written, so that several proxies can share one server.
	// [DefaultKeyPrefix]
	KeyPrefix string `yaml:"key_prefix"`
}

// Enabled reports whether c names a server.
func (c Config) Enabled() bool { return c.Redis.Addr != "" }

// Validate checks c as New would, without changing it.
func (c Config) Validate() error {
	_, err := c.WithDefaults()
	return err
}

// WithDefaults is c with every unset key at its default, or the error of the first key
// that cannot take effect.
func (c Config) WithDefaults() (Config, error) {
	r := &c.Redis
	if r.Addr == "" {
		if c.SlotTTL != 0 || r.Username != "" || r.PasswordFile != "" || r.DB != 0 || r.TLS || r.Timeout != nil || r.KeyPrefix != "" {
			return c, errors.New("shared_state.redis.addr: required: the other shared_state keys say how to use a server, and none is named")
		}
		return c, nil
	}
	if _, port, err := net.SplitHostPort(r.Addr); err != nil || port == "" {
		return c, fmt.Errorf("shared_state.redis.addr: %q is not host:port", r.Addr)
	}
	if r.Timeout == nil {
		d := DefaultTimeout
		r.Timeout = &d
	}
	switch t := *r.Timeout; {
	case t <= 0:
		return c, fmt.Errorf("shared_state.redis.timeout: %s is not positive: it is how long a request may wait for Redis (the default is %s)", t, DefaultTimeout)
	case t > MaxTimeout:
		return c, fmt.Errorf("shared_state.redis.timeout: %s is more than %s: every request may wait this long for Redis on its way in; a Redis that slow is better treated as down", t, MaxTimeout)
	}
	if r.DB < 0 {
		return c, fmt.Errorf("shared_state.redis.db: %d is negative", r.DB)
	}
	if r.KeyPrefix == "" {
		r.KeyPrefix = DefaultKeyPrefix
	}
	if len(r.KeyPrefix) > maxKeyPrefix {
		return c, fmt.Errorf("shared_state.redis.key_prefix: %d bytes, more than %d", len(r.KeyPrefix), maxKeyPrefix)
	}
	switch {
	case c.SlotTTL == 0:
		c.SlotTTL = DefaultSlotTTL
	case c.SlotTTL < minSlotTTL:
		return c, fmt.Errorf("shared_state.slot_ttl: %s is less than %s: a live replica refreshes its slots every third of it, and a refresh that waits for a slow Redis must still land in time", c.SlotTTL, minSlotTTL)
	}
	return c, nil
}

// password reads the password file; "" when none is configured.
func (r RedisConfig) password() (string, error) {
	if r.PasswordFile == "" {
		return "", nil
	}
	b, err := os.ReadFile(r.PasswordFile)
	if err != nil {
		return "", fmt.Errorf("shared_state.redis.password_file: %w", err)
	}
	p := strings.TrimRight(string(b), " \t\r\n")
	if p == "" {
		return "", fmt.Errorf("shared_state.redis.password_file: %s is empty", r.PasswordFile)
	}
	return p, nil
}
