package bench

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	vegeta "github.com/tsenart/vegeta/v12/lib"

	"github.com/pdproxy/pdproxy/engine"
)

// newClient is the load generator's HTTP client: keep-alive, enough idle connections for
// every worker, no compression (the backend never compresses, and asking would make the
// proxy strip the header on one path only).
func newClient(conns int) *http.Client {
	return &http.Client{
		Timeout: time.Minute,
		Transport: &http.Transport{
			Proxy:               nil,
			MaxIdleConns:        conns,
			MaxIdleConnsPerHost: conns,
			DisableCompression:  true,
			ForceAttemptHTTP2:   false,
		},
	}
}

// pdDirect is what a client that knows P/D would do without a proxy: the prefill call, then
// the decode call with the prefiller's params. It is a RoundTripper so that the load
// generator times the pair as one request; the body sent for the decode is the client's with
// the params added, and the prefill body is built once.
type pdDirect struct {
	base        http.RoundTripper
	prefillURL  string
	prefillBody []byte
}

func newPDDirect(base http.RoundTripper, prefillURL string, clientBody []byte) (*pdDirect, error) {
	f, err := engine.ParseFields(clientBody)
	if err != nil {
		return nil, err
	}
	pb, err := engine.PrefillBody(f, engine.APICompletions)
	if err != nil {
		return nil, err
	}
	return &pdDirect{base: base, prefillURL: prefillURL + "/v1/completions", prefillBody: pb}, nil
}

func (p *pdDirect) RoundTrip(req *http.Request) (*http.Response, error) {
	body, err := io.ReadAll(req.Body)
	req.Body.Close()
	if err != nil {
		return nil, err
	}
	pre, err := http.NewRequestWithContext(req.Context(), http.MethodPost, p.prefillURL, bytes.NewReader(p.prefillBody))
	if err != nil {
		return nil, err
	}
	pre.Header.Set("Content-Type", "application/json")
	resp, err := p.base.RoundTrip(pre)
	if err != nil {
		return nil, err
	}
	answer, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("prefill answered %d", resp.StatusCode)
	}
	params, err := engine.ParsePrefillResponse(answer)
	if err != nil {
		return nil, err
	}
	dec := make([]byte, 0, len(body)+len(params)+24)
	dec = append(dec, body[:bytes.LastIndexByte(body, '}')]...)
	dec = append(dec, `,"kv_transfer_params":`...)
	dec = append(dec, params...)
	dec = append(dec, '}')
	out, err := http.NewRequestWithContext(req.Context(), http.MethodPost, req.URL.String(), bytes.NewReader(dec))
	if err != nil {
		return nil, err
	}
	out.Header = req.Header.Clone()
	return p.base.RoundTrip(out)
}

// CloseIdleConnections lets the client's CloseIdleConnections reach the base transport.
func (p *pdDirect) CloseIdleConnections() {
	if c, ok := p.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// loadResult is one attack: requests that streamed to the end, and those that did not.
type loadResult struct {
	ok, failed int
	firstErr   string
	wall       time.Duration
	latencies  []time.Duration // of the ok requests, sorted
}

// rate is the completed requests per second of wall time.
func (r loadResult) rate() float64 {
	if r.wall <= 0 {
		return 0
	}
	return float64(r.ok) / r.wall.Seconds()
}

// quantile is the q-th latency of the ok requests (nearest rank).
func (r loadResult) quantile(q float64) time.Duration {
	if len(r.latencies) == 0 {
		return 0
	}
	i := int(q*float64(len(r.latencies))+0.5) - 1
	return r.latencies[max(0, min(i, len(r.latencies)-1))]
}

// attackSpec is one vegeta attack: a target, a pace and a duration.
type attackSpec struct {
	client  *http.Client
	url     string
	body    []byte
	header  http.Header
	rate    int    // requests per second; 0 means as fast as the workers go
	workers uint64 // fixed workers when rate is 0, else the initial number
	dur     time.Duration
}

// attack runs the attack and waits for every request it started. A request counts as ok only
// when it answered 200 and its stream ended with [DONE]: a truncated stream is a failure.
func attack(s attackSpec) loadResult {
	began := time.Now()
	_, results := start(s)
	return collect(results, began)
}

// start begins an attack and returns the attacker (Stop ends it early) and its results.
func start(s attackSpec) (*vegeta.Attacker, <-chan *vegeta.Result) {
	opts := []func(*vegeta.Attacker){vegeta.Client(s.client), vegeta.Workers(s.workers)}
	pacer := vegeta.Pacer(vegeta.Rate{Freq: s.rate, Per: time.Second})
	if s.rate == 0 {
		opts = append(opts, vegeta.MaxWorkers(s.workers))
	}
	a := vegeta.NewAttacker(opts...)
	tgt := vegeta.Target{Method: http.MethodPost, URL: s.url, Body: s.body, Header: s.header.Clone()}
	if tgt.Header == nil {
		tgt.Header = http.Header{}
	}
	tgt.Header.Set("Content-Type", "application/json")
	return a, a.Attack(vegeta.NewStaticTargeter(tgt), pacer, s.dur, "")
}

func collect(results <-chan *vegeta.Result, began time.Time) loadResult {
	var r loadResult
	for res := range results {
		if res.Code == http.StatusOK && res.Error == "" && completeStream(res.Body) {
			r.ok++
			r.latencies = append(r.latencies, res.Latency)
			continue
		}
		r.failed++
		if r.firstErr == "" {
			r.firstErr = fmt.Sprintf("status %d %s: %.200s", res.Code, res.Error, res.Body)
		}
	}
	r.wall = time.Since(began)
	slices.Sort(r.latencies)
	return r
}
