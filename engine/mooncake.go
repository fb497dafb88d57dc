package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"strconv"
	"time"
)

// KindMooncake is vLLM's MooncakeConnector.
const KindMooncake = "mooncake"

// mooncakeHold is VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT's default: how long a prefiller holds a
// finished prefill's KV for a decoder that never pulls it.
const mooncakeHold = 480 * time.Second

// defaultMooncakeBootstrapPort is VLLM_MOONCAKE_BOOTSTRAP_PORT's default.
const defaultMooncakeBootstrapPort = 8998

// dpRankHeader names the data-parallel rank of an engine that serves a call (vLLM's API
// server with --data-parallel-size).
const dpRankHeader = "X-data-parallel-rank"

// DataParallelRankHeader is dpRankHeader, for callers that name a rank on other calls.
const DataParallelRankHeader = dpRankHeader

type mooncake struct{}

// Mooncake is vLLM with its MooncakeConnector: both legs go out at once under one transfer
// id that the proxy makes; the prefiller's bootstrap server (GET /query) names the engine id
// of each data-parallel rank, and the decoder pulls the KV from the prefiller's rank by that
// id. There is no explicit abort: closing a leg's connection aborts it.
var Mooncake Paired = mooncake{}

func (mooncake) Kind() string                 { return KindMooncake }
func (mooncake) KVHoldTimeout() time.Duration { return mooncakeHold }

// AnswersAfterTransfer is false: the prefiller answers as its prefill ends, and holds the KV
// for the decoder's pull from then on.
func (mooncake) AnswersAfterTransfer() bool { return false }

// TokensIn: the MooncakeConnector is vLLM's, whose /inference/v1/generate passes
// kv_transfer_params to the engine as its completions do.
func (mooncake) TokensIn() bool { return true }

// RejectionFreesKV is false: a decoder's refusal tells the prefiller nothing here; its hold
// ends when the legs are aborted or at its timer.
func (mooncake) RejectionFreesKV(int) bool { return false }

// LoadMetrics are vLLM's: the MooncakeConnector changes nothing in its gauges.
func (mooncake) LoadMetrics() (waiting, running, kvUsage, requests string) {
	return VLLM.(vllm).LoadMetrics()
}

// CacheMetrics are vLLM's too.
func (mooncake) CacheMetrics() (prompt, cached, capacity string) {
	return VLLM.(vllm).CacheMetrics()
}

// Legs: the prefill leg asks for a remote decode under the transfer id, one token, not
// streamed, on the rank the proxy chose (X-data-parallel-rank); the decode leg names the
// prefiller's bootstrap server, engine id and rank, and the same transfer id. The rest is the
// client's body, byte for byte; a client's own kv_transfer_params never pass.
func (mooncake) Legs(f *Fields, leg Leg) (LegCalls, error) {
	if leg.TransferID == "" || leg.EngineID == "" || leg.Host == "" || leg.Port <= 0 {
		return LegCalls{}, errors.New("mooncake legs need a transfer id, the prefiller's engine id and its bootstrap server")
	}
	pre, err := json.Marshal(struct {
		DoRemoteDecode  bool   `json:"do_remote_decode"`
		DoRemotePrefill bool   `json:"do_remote_prefill"`
		TransferID      string `json:"transfer_id"`
	}{true, false, leg.TransferID})
	if err != nil {
		return LegCalls{}, err
	}
	rank := max(leg.Rank, 0)
	dec, err := json.Marshal(struct {
		DoRemotePrefill     bool   `json:"do_remote_prefill"`
		DoRemoteDecode      bool   `json:"do_remote_decode"`
		RemoteBootstrapAddr string `json:"remote_bootstrap_addr"`
		RemoteEngineID      string `json:"remote_engine_id"`
		RemoteDPRank        int    `json:"remote_dp_rank"`
		TransferID          string `json:"transfer_id"`
	}{true, false, "http://" + net.JoinHostPort(leg.Host, strconv.Itoa(leg.Port)), leg.EngineID, rank, leg.TransferID})
	if err != nil {
		return LegCalls{}, err
	}
	drain, err := DrainBody(f, leg.API, dec)
	if err != nil {
		return LegCalls{}, err
	}
	prefill, err := oneToken(f, leg.API, prefillDrops, pre)
	if err != nil {
		return LegCalls{}, err
	}
	calls := LegCalls{Decode: f.rewrite(decodeDrop, set{"kv_transfer_params", dec}), Drain: drain, Prefill: prefill}
	if leg.Rank >= 0 {
		calls.PrefillHeader = http.Header{}
		calls.PrefillHeader.Set(dpRankHeader, strconv.Itoa(leg.Rank))
	}
	return calls, nil
}

// Bootstrap asks the prefiller's bootstrap server (bootstrapPort, or 8998) for its ranks'
// engine ids: GET /query answers {"<rank>": {"engine_id": "..."}, ...}. An older vLLM
// server, whose decode params named bootstrap_server_host and _port and no transfer id, has
// no such answer: it is refused with an error that says so.
func (mooncake) Bootstrap(ctx context.Context, client *http.Client, baseURL string, bootstrapPort int) (Bootstrap, error) {
	port := bootstrapPort
	if port <= 0 {
		port = defaultMooncakeBootstrapPort
	}
	host, err := hostOf(baseURL)
	if err != nil {
		return Bootstrap{}, err
	}
	url := "http://" + net.JoinHostPort(host, strconv.Itoa(port)) + "/query"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return Bootstrap{}, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return Bootstrap{}, fmt.Errorf("mooncake bootstrap: %w", err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return Bootstrap{}, fmt.Errorf("mooncake bootstrap: read %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return Bootstrap{}, fmt.Errorf("mooncake bootstrap: %s answered %d: a vLLM older than the transfer-id protocol (bootstrap_server_host/_port) is not supported", url, resp.StatusCode)
	}
	var ranks map[string]struct {
		EngineID string `json:"engine_id"`
	}
	if err := json.Unmarshal(raw, &ranks); err != nil {
		return Bootstrap{}, fmt.Errorf("mooncake bootstrap: %s is not a map of ranks to engine ids (a vLLM older than the transfer-id protocol is not supported): %w", url, err)
	}
	ids := map[int]string{}
	for k, v := range ranks {
		r, err := strconv.Atoi(k)
		if err != nil || r < 0 || v.EngineID == "" {
			return Bootstrap{}, fmt.Errorf("mooncake bootstrap: %s names rank %q with engine id %q", url, k, v.EngineID)
		}
		ids[r] = v.EngineID
	}
	if len(ids) == 0 {
		return Bootstrap{}, fmt.Errorf("mooncake bootstrap: %s names no rank", url)
	}
	return Bootstrap{Port: port, EngineIDs: ids}, nil
}

// Ranks lists a bootstrap's ranks in order.
func (b Bootstrap) Ranks() []int {
	out := make([]int, 0, len(b.EngineIDs))
	for r := range b.EngineIDs {
		out = append(out, r)
	}
	sort.Ints(out)
	return out
}

func hostOf(baseURL string) (string, error) {
	req, err := http.NewRequest(http.MethodGet, baseURL, nil)
	if err != nil {
		return "", fmt.Errorf("mooncake bootstrap: %w", err)
	}
	return req.URL.Hostname(), nil
}

var (
	_ Paired   = mooncake{}
	_ TokensIn = mooncake{}
)
