package e2e

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

const secCompletion = `{"model":"sim","prompt":"hello","max_tokens":3}`

// secRequest sends one request through client with an optional Authorization header and
// returns the status and the whole body.
func secRequest(t *testing.T, client *http.Client, method, url, body, auth string) (int, http.Header, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read: %v", method, url, err)
	}
	return resp.StatusCode, resp.Header, b
}

// simRequests is how many requests every in-process engine has accepted.
func (s *stack) simRequests() int {
	n := 0
	for _, u := range s.allSimURLs() {
		n += kv(s.t, u).RequestsTotal
	}
	return n
}

func TestAPIKeysGuardEveryRouteButTheOpenOnes(t *testing.T) {
	keyFile := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keyFile, []byte("# the keys of team a\nsk-file-key\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, c *app.Config)
		key   string
	}{
		{name: "keys from a file", key: "sk-file-key", setup: func(_ *testing.T, c *app.Config) { c.Proxy.APIKeysFile = keyFile }},
		{name: "keys from an environment variable", key: "sk-env-key-2", setup: func(t *testing.T, c *app.Config) {
			t.Setenv("PDPROXY_E2E_KEYS", "sk-env-key-1,sk-env-key-2")
			c.Proxy.APIKeysEnv = "PDPROXY_E2E_KEYS"
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startStack(t, fastSims, func(c *app.Config) { tc.setup(t, c) })
			client := http.DefaultClient
			for _, bad := range []struct{ name, auth string }{
				{"no key", ""},
				{"a wrong key", "Bearer sk-wrong"},
				{"the key without its scheme", tc.key},
			} {
				for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
					status, hdr, body := secRequest(t, client, http.MethodPost, s.url+path, secCompletion, bad.auth)
					if status != http.StatusUnauthorized || hdr.Get("WWW-Authenticate") != "Bearer" {
						t.Fatalf("%s on %s: status %d, WWW-Authenticate %q; want 401 and Bearer", bad.name, path, status, hdr.Get("WWW-Authenticate"))
					}
					var e struct {
						Error struct{ Message, Type, Code string } `json:"error"`
					}
					if err := json.Unmarshal(body, &e); err != nil || e.Error.Type != "authentication_error" || e.Error.Code != "invalid_api_key" || e.Error.Message == "" {
						t.Fatalf("%s on %s: answer %s is not an OpenAI authentication_error (%v)", bad.name, path, body, err)
					}
				}
			}
			if n := s.simRequests(); n != 0 {
				t.Fatalf("the engines accepted %d requests from clients with no valid key, want 0", n)
			}
			if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"code": "401"}); got != 6 {
				t.Errorf("pdproxy_requests_total{code=401} = %v, want 6", got)
			}
			for _, path := range []string{"/health", "/ready", "/metrics"} {
				if status, _, body := secRequest(t, client, http.MethodGet, s.url+path, "", ""); status != http.StatusOK {
					t.Errorf("GET %s without a key: status %d, want 200 (open by default): %s", path, status, body)
				}
			}
			for _, path := range []string{"/v1/models", "/debug/requests", "/debug/backends"} {
				if status, _, _ := secRequest(t, client, http.MethodGet, s.url+path, "", ""); status != http.StatusUnauthorized {
					t.Errorf("GET %s without a key: status %d, want 401", path, status)
				}
				if status, _, _ := secRequest(t, client, http.MethodGet, s.url+path, "", "Bearer "+tc.key); status != http.StatusOK {
					t.Errorf("GET %s with the key: status %d, want 200", path, status)
				}
			}
			if status, _, body := secRequest(t, client, http.MethodPost, s.url+"/v1/completions", secCompletion, "Bearer "+tc.key); status != http.StatusOK {
				t.Fatalf("with the right key: status %d, want 200: %s", status, body)
			}
			if n := s.simRequests(); n == 0 {
				t.Error("the engines saw nothing of the request with the right key")
			}
			s.assertQuiet(10 * time.Second)
		})
	}
}

// selfSignedCert writes a fresh ECDSA certificate for 127.0.0.1 and localhost and its key,
// and returns the two files and a pool that trusts the certificate.
func selfSignedCert(t *testing.T) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: "pdproxy e2e"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := os.WriteFile(certFile, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	pool = x509.NewCertPool()
	pool.AppendCertsFromPEM(certPEM)
	return certFile, keyFile, pool
}

// tlsClient is a client with tlsConf that negotiates HTTP/2 when the server offers it; its
// connections close when the test ends.
func tlsClient(t *testing.T, tlsConf *tls.Config) *http.Client {
	tr := &http.Transport{TLSClientConfig: tlsConf, ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func TestTLSListenerServesHTTPSWithHTTP2(t *testing.T) {
	certFile, keyFile, pool := selfSignedCert(t)
	s := startStack(t, fastSims, func(c *app.Config) { c.TLSCertFile, c.TLSKeyFile = certFile, keyFile })
	if !strings.HasPrefix(s.url, "https://") {
		t.Fatalf("URL %q, want https", s.url)
	}
	t.Run("a client trusting the certificate gets its answer over HTTP/2", func(t *testing.T) {
		client := tlsClient(t, &tls.Config{RootCAs: pool})
		resp := postWith(t, client, s.url+"/v1/completions", `{"model":"sim","prompt":"hi","max_tokens":5,"stream":true}`)
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.ProtoMajor != 2 {
			t.Fatalf("status %d over %s, want 200 over HTTP/2", resp.StatusCode, resp.Proto)
		}
		if ev := sseEvents(t, resp.Body); len(ev) == 0 || ev[len(ev)-1] != "[DONE]" {
			t.Fatalf("stream over HTTP/2 = %q, want chunks then [DONE]", ev)
		}
	})
	t.Run("HTTP/1.1 over TLS is served too", func(t *testing.T) {
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}} // no h2 without ForceAttemptHTTP2
		t.Cleanup(tr.CloseIdleConnections)
		status, _, body := secRequest(t, &http.Client{Transport: tr}, http.MethodPost, s.url+"/v1/completions", secCompletion, "")
		if status != http.StatusOK {
			t.Fatalf("status %d: %s", status, body)
		}
	})
	t.Run("a client that does not trust the certificate is refused", func(t *testing.T) {
		_, err := tlsClient(t, &tls.Config{}).Get(s.url + "/health")
		if err == nil || !strings.Contains(err.Error(), "certificate") {
			t.Fatalf("GET with the system roots: %v, want a certificate error", err)
		}
	})
	t.Run("TLS 1.1 is refused", func(t *testing.T) {
		_, err := tlsClient(t, &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS10, MaxVersion: tls.VersionTLS11}).Get(s.url + "/health")
		if err == nil {
			t.Fatal("a TLS 1.1 client was served")
		}
	})
	t.Run("plain HTTP to the TLS port gets no answer from the API", func(t *testing.T) {
		status, _, _ := secRequest(t, http.DefaultClient, http.MethodPost, "http://"+s.m.Addr()+"/v1/completions", secCompletion, "")
		if status != http.StatusBadRequest {
			t.Fatalf("plain HTTP: status %d, want Go's 400 for HTTP on an HTTPS port", status)
		}
	})
	s.assertQuiet(10 * time.Second)
}

// postWith posts a JSON body through client; the caller closes the answer.
func postWith(t *testing.T, client *http.Client, url, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp
}

func TestTLSFlagsAndHalfConfiguredTLS(t *testing.T) {
	certFile, keyFile, _ := selfSignedCert(t)
	c, err := app.LoadConfig([]string{"--tls-cert", certFile, "--tls-key", keyFile}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.TLSCertFile != certFile || c.TLSKeyFile != keyFile {
		t.Errorf("--tls-cert/--tls-key gave %q, %q", c.TLSCertFile, c.TLSKeyFile)
	}
	if _, err := app.LoadConfig([]string{"--tls-cert", certFile}, io.Discard); err == nil || !strings.Contains(err.Error(), "set both") {
		t.Errorf("--tls-cert alone: %v, want an error asking for both", err)
	}
	cfg := app.DefaultConfig()
	cfg.Listen, cfg.TLSCertFile, cfg.TLSKeyFile = "127.0.0.1:0", certFile, certFile // not a key
	m, err := app.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background()); err == nil || !strings.Contains(err.Error(), "tls_cert_file, tls_key_file") {
		m.Shutdown(context.Background())
		t.Fatalf("Start with a certificate as the key: %v, want an error naming the keys", err)
	}
}

// tlsSimDecoder runs a simulated decoder behind httptest's TLS server and returns it with
// its certificate written as a PEM file.
func tlsSimDecoder(t *testing.T) (srv *httptest.Server, caFile string) {
	t.Helper()
	cfg := sim.DefaultConfig()
	cfg.Role = "decode"
	cfg.ITL = time.Millisecond
	eng, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx) }()
	srv = httptest.NewTLSServer(eng.Handler())
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim engine: %v", err)
		}
	})
	caFile = filepath.Join(t.TempDir(), "engine-ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	return srv, caFile
}

func TestHTTPSBackends(t *testing.T) {
	engine, caFile := tlsSimDecoder(t)
	for _, tc := range []struct {
		name      string
		backend   func(*routerconfig.BackendConfig)
		want      int
		logged    string // a warning that must be logged
		loggedMsg string
	}{
		{name: "an engine whose certificate chains to tls_ca_file serves",
			backend: func(b *routerconfig.BackendConfig) { b.TLSCAFile = caFile }, want: http.StatusOK},
		{name: "by default an engine with an untrusted certificate is a 502, and the log says why",
			backend: func(*routerconfig.BackendConfig) {}, want: http.StatusBadGateway,
			loggedMsg: "request", logged: "x509: certificate signed by unknown authority"},
		{name: "tls_insecure_skip_verify serves, and warns that nothing is verified",
			backend: func(b *routerconfig.BackendConfig) { b.TLSInsecureSkipVerify = true }, want: http.StatusOK,
			loggedMsg: "tls certificate verification is off", logged: "tls_insecure_skip_verify"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			logger := zap.New(zapcore.NewTee(core, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Core()))
			s := startStackWith(t, logger, func(c *app.Config) {
				c.Sims = nil
				b := routerconfig.BackendConfig{Name: "tls-decode", URL: engine.URL, Role: routerconfig.RoleDecode, Engine: "sim"}
				tc.backend(&b)
				c.Router.Backends = []routerconfig.BackendConfig{b}
				c.Router.Health.Interval = -1 // the request, not a health check, meets the certificate
			})
			status, _, body := secRequest(t, http.DefaultClient, http.MethodPost, s.url+"/v1/completions", secCompletion, "")
			if status != tc.want {
				t.Fatalf("status %d, want %d: %s", status, tc.want, body)
			}
			if tc.want != http.StatusOK && strings.Contains(string(body), "x509") {
				t.Errorf("the client's answer carries the internal cause: %s", body)
			}
			if tc.logged != "" {
				found := false
				for _, e := range logs.FilterMessageSnippet(tc.loggedMsg).All() {
					line, _ := json.Marshal(e.ContextMap())
					found = found || strings.Contains(e.Message+string(line), tc.logged)
				}
				if !found {
					t.Errorf("no warning %q mentioning %q; logged: %v", tc.loggedMsg, tc.logged, logs.All())
				}
			}
		})
	}
}

func TestOversizedHeadersGet431AndTheProxyStaysUp(t *testing.T) {
	s := startStack(t, fastSims)
	req, err := http.NewRequest(http.MethodPost, s.url+"/v1/completions", strings.NewReader(secCompletion))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Padding", strings.Repeat("a", 100<<10))
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatalf("POST with a 100 KiB header: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("status %d, want 431", resp.StatusCode)
	}
	if n := s.simRequests(); n != 0 {
		t.Errorf("the engines accepted %d requests, want 0", n)
	}
	if status, _, body := secRequest(t, http.DefaultClient, http.MethodPost, s.url+"/v1/completions", secCompletion, ""); status != http.StatusOK {
		t.Fatalf("the next request: status %d, want 200: %s", status, body)
	}
	s.assertQuiet(10 * time.Second)
}

// lockedBuffer is a log sink that handlers on many goroutines may write to.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) Sync() error { return nil }

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestNoKeyOrPromptInAnyLogLine(t *testing.T) {
	const (
		key      = "sk-canary-key-5d8c1e"
		wrongKey = "sk-canary-wrong-key-93b0a4"
		canary   = "canary-prompt-0c7f2a"
	)
	t.Setenv("PDPROXY_E2E_LOG_KEYS", key)
	var buf lockedBuffer
	logger := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), &buf, zapcore.DebugLevel))
	s := startStackWith(t, logger, fastSims, func(c *app.Config) {
		c.Proxy.APIKeysEnv = "PDPROXY_E2E_LOG_KEYS"
	})
	completion := `{"model":"sim","prompt":"` + canary + `","max_tokens":4}`
	chat := `{"model":"sim","messages":[{"role":"user","content":"` + canary + `"}],"max_tokens":4,"stream":true}`
	for _, tc := range []struct {
		name, path, body, auth string
		want                   int
	}{
		{"a completion", "/v1/completions", completion, "Bearer " + key, 200},
		{"a streamed chat", "/v1/chat/completions", chat, "Bearer " + key, 200},
		{"a wrong key", "/v1/completions", completion, "Bearer " + wrongKey, 401},
		{"a malformed key header", "/v1/completions", completion, wrongKey, 401},
		{"a bad request", "/v1/completions", `{"model":"sim","prompt":"` + canary + `","max_tokens":-1}`, "Bearer " + key, 400},
		{"a request with broken JSON", "/v1/completions", `{"model":"sim","prompt":"` + canary, "Bearer " + key, 400},
	} {
		if status, _, body := secRequest(t, http.DefaultClient, http.MethodPost, s.url+tc.path, tc.body, tc.auth); status != tc.want {
			t.Fatalf("%s: status %d, want %d: %s", tc.name, status, tc.want, body)
		}
	}
	// A client that leaves mid-stream walks the abort paths, with their debug lines.
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url+"/v1/completions",
		strings.NewReader(`{"model":"sim","prompt":"`+canary+`","max_tokens":100000,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := resp.Body.Read(make([]byte, 64)); err != nil {
		t.Fatalf("first bytes of the stream: %v", err)
	}
	cancel()
	resp.Body.Close()
	s.assertQuiet(10 * time.Second)

	logs := buf.String()
	for _, want := range []string{`"level":"debug"`, `"msg":"request"`, `"msg":"request refused: no valid api key"`, `"msg":"client gone"`} {
		if !strings.Contains(logs, want) {
			t.Fatalf("the logs lack %s, so they do not show what the test meant to check:\n%s", want, logs)
		}
	}
	for _, secret := range []string{key, wrongKey, canary} {
		for _, line := range strings.Split(logs, "\n") {
			if strings.Contains(line, secret) {
				t.Errorf("a log line carries %q: %s", secret, line)
			}
		}
	}
}
