package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"
)

// KindSGLang is SGLang's prefill/decode disaggregation.
const KindSGLang = "sglang"

// Paired is an engine whose prefill and decode legs go out together and find each other
// through the prefiller's bootstrap server (SGLang's rooms, vLLM's MooncakeConnector's
// transfer ids): the decoder pulls the KV; the prefiller holds it until then. The proxy runs
// such a request as two legs at once, relays the decoder's answer, and reads and drops the
// prefiller's.
type Paired interface {
	Engine
	// Legs are the two legs' bodies (and headers), built from the client's body.
	Legs(f *Fields, leg Leg) (LegCalls, error)
	// Bootstrap asks a prefiller what pairing needs: the port of its bootstrap server
	// (bootstrapPort, when configured, is taken as it is), and the engine id of each of its
	// data-parallel ranks where the protocol names them.
	Bootstrap(ctx context.Context, client *http.Client, baseURL string, bootstrapPort int) (Bootstrap, error)
	// AnswersAfterTransfer reports whether the prefiller answers its leg only once the
	// decoder has the KV (SGLang), so that its answer ends the hold; else (Mooncake) it
	// answers when the prefill is done, and holds the KV until the decoder pulls it.
	AnswersAfterTransfer() bool
}

// Bootstrap is what a prefiller's bootstrap server told the proxy.
type Bootstrap struct {
	Port int
	// EngineIDs are the engine ids by data-parallel rank (Mooncake); nil when the protocol
	// has none (SGLang).
	EngineIDs map[int]string
}

// Leg is what pairs a request's two legs: the prefiller's bootstrap server, a room (SGLang)
// or a transfer id and the prefiller's engine id and rank (Mooncake), and the request's id on
// both engines. Prompts is how many prompts the body holds (a batch gets one room and one
// rid per prompt).
type Leg struct {
	Host       string
	Port       int
	Room       uint64
	RID        string
	Prompts    int
	TransferID string
	EngineID   string
	// Rank is the prefiller's data-parallel rank that serves the prefill leg; -1: none named.
	Rank int
	// API is the API of the body, for an engine whose prefill leg is bounded to one token.
	API API
}

// LegCalls are the bodies of a request's two legs, and headers a leg must carry.
type LegCalls struct {
	Prefill, Decode             []byte
	PrefillHeader, DecodeHeader http.Header
	// Drain, where the engine has no explicit abort, is a one-token decode leg whose only
	// purpose is to make a decoder pull KV a prefiller holds for legs that were aborted
	// after the prefill ended; nil where an abort frees it.
	Drain []byte
}

// NewRoom is a random bootstrap room in [0, 2^63-1], as SGLang's own router draws them.
func NewRoom() uint64 { return rand.Uint64() >> 1 }

type sglang struct{}

// SGLang is SGLang's disaggregation: parallel legs paired by a bootstrap room, and an explicit
// abort on both engines.
var SGLang Paired = sglang{}

func (sglang) Kind() string { return KindSGLang }

// MessagesByChat: SGLang's Messages request model has no bootstrap fields, so the legs of a
// Messages request would not pair; its chat completions route has them.
func (sglang) MessagesByChat() bool { return true }

// LoadMetrics names the series on SGLang's /metrics (served with --enable-metrics) that the
// router reads (enginemetrics.LoadReporter): its load gauges, and its count of requests served.
func (sglang) LoadMetrics() (waiting, running, kvUsage, requests string) {
	return "sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", "sglang:num_requests_total"
}

// CacheMetrics names the series on SGLang's /metrics that count the prompt tokens it was
// sent and found cached (by cache_source; the router counts the device's) and its KV pool's
// size in tokens (enginemetrics.CacheReporter).
func (sglang) CacheMetrics() (prompt, cached, capacity string) {
	return "sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:max_total_num_tokens"
}

// KVHoldTimeout is zero: with NIXL a prefiller holds a room nobody claims until it restarts,
// so only the proxy's aborts free it. The proxy forwards no params, so it keeps no deadline.
func (sglang) KVHoldTimeout() time.Duration { return 0 }

// AnswersAfterTransfer is true: SGLang's prefiller answers once the room's KV went out.
func (sglang) AnswersAfterTransfer() bool { return true }

// RejectionFreesKV is false: SGLang's legs carry no params, and a refused leg is answered by
// aborting both.
func (sglang) RejectionFreesKV(int) bool { return false }
func (sglang) Abort(ctx context.Context, c *http.Client, baseURL, id string) error {
	return abortRequest(ctx, c, baseURL, id)
}

// LegBody adds bootstrap_host, bootstrap_port, bootstrap_room and rid to the client's body;
// for several prompts each is an array with one entry per prompt, the rids suffixed with the
// prompt's index in fixed width so that they stay prefix-free. The rest is the client's, byte
// for byte; a client's own bootstrap fields or rid never pass.
func (sglang) Legs(f *Fields, leg Leg) (LegCalls, error) {
	b := legBody(f, leg)
	return LegCalls{Prefill: b, Decode: b}, nil
}

func legBody(f *Fields, leg Leg) []byte {
	host, _ := json.Marshal(leg.Host)
	port := []byte(strconv.Itoa(leg.Port))
	room := []byte(strconv.FormatUint(leg.Room, 10))
	rid, _ := json.Marshal(leg.RID)
	if leg.Prompts > 1 {
		hosts, ports, rooms := []any{}, []any{}, []any{}
		for i := range leg.Prompts {
			hosts = append(hosts, leg.Host)
			ports = append(ports, leg.Port)
			r := leg.Room + uint64(i)
			if r >= 1<<63 {
				r -= 1 << 63
			}
			rooms = append(rooms, r)
		}
		rids := leg.RIDs()
		host, _ = json.Marshal(hosts)
		port, _ = json.Marshal(ports)
		room, _ = json.Marshal(rooms)
		rid, _ = json.Marshal(rids)
	}
	return f.rewrite(sglangDrop, set{"bootstrap_host", host}, set{"bootstrap_port", port},
		set{"bootstrap_room", room}, set{"rid", rid})
}

// RIDs are the ids the engines know the leg's requests by: the rid, or with several prompts
// one per prompt, suffixed with its index in fixed width (so that they stay prefix-free). An
// abort must name each: SGLang ignores an abort whose rid is not exactly one in flight.
func (leg Leg) RIDs() []string {
	if leg.Prompts <= 1 {
		return []string{leg.RID}
	}
	rids := make([]string, leg.Prompts)
	for i := range rids {
		rids[i] = fmt.Sprintf("%s-%04d", leg.RID, i)
	}
	return rids
}

var sglangDrop = []string{"bootstrap_host", "bootstrap_port", "bootstrap_room", "rid", "kv_transfer_params"}

// Bootstrap is the configured port, or disaggregation_bootstrap_port from GET /server_info
// (/get_server_info on servers older than its rename).
func (sglang) Bootstrap(ctx context.Context, client *http.Client, baseURL string, bootstrapPort int) (Bootstrap, error) {
	if bootstrapPort > 0 {
		return Bootstrap{Port: bootstrapPort}, nil
	}
	port, err := sglangBootstrapPort(ctx, client, baseURL)
	return Bootstrap{Port: port}, err
}

func sglangBootstrapPort(ctx context.Context, client *http.Client, baseURL string) (int, error) {
	var last error
	for _, path := range []string{"/server_info", "/get_server_info"} {
		port, err := bootstrapPortFrom(ctx, client, baseURL+path)
		if err == nil {
			return port, nil
		}
		last = err
	}
	return 0, last
}

func bootstrapPortFrom(ctx context.Context, client *http.Client, url string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("discover bootstrap port: %w", err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return 0, fmt.Errorf("discover bootstrap port: read %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("discover bootstrap port: %s answered %d", url, resp.StatusCode)
	}
	var info struct {
		Mode string `json:"disaggregation_mode"`
		Port *int   `json:"disaggregation_bootstrap_port"`
	}
	if err := json.Unmarshal(raw, &info); err != nil {
		return 0, fmt.Errorf("discover bootstrap port: %s: %w", url, err)
	}
	if info.Mode != "" && info.Mode != "prefill" {
		return 0, fmt.Errorf("discover bootstrap port: %s says disaggregation_mode %q, not prefill", url, info.Mode)
	}
	if info.Port == nil {
		return defaultBootstrapPort, nil
	}
	if *info.Port <= 0 || *info.Port > 65535 {
		return 0, fmt.Errorf("discover bootstrap port: %s says port %d", url, *info.Port)
	}
	return *info.Port, nil
}

// defaultBootstrapPort is SGLang's --disaggregation-bootstrap-port default.
const defaultBootstrapPort = 8998

// Interface guards.
var (
	_ Paired  = sglang{}
	_ Aborter = sglang{}
)
