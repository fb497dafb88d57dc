package router

import (
	"encoding/pem"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// tlsEngine is an https engine with httptest's self-signed certificate (valid for
// example.com and 127.0.0.1); it records the Authorization header of the last call.
type tlsEngine struct {
	*httptest.Server
	caFile string // the certificate as a PEM file, to trust it
	auth   chan string
}

func newTLSEngine(t *testing.T) *tlsEngine {
	t.Helper()
	e := &tlsEngine{auth: make(chan string, 16)}
	e.Server = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case e.auth <- r.Header.Get("Authorization"):
		default:
		}
		io.WriteString(w, "ok")
	}))
	t.Cleanup(e.Close)
	e.caFile = filepath.Join(t.TempDir(), "ca.pem")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: e.Certificate().Raw})
	if err := os.WriteFile(e.caFile, pemBytes, 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

// get calls the engine through the backend's client, as the proxy does, and returns the
// error of the call.
func get(t *testing.T, b *Backend, hdr http.Header) error {
	t.Helper()
	t.Cleanup(b.Client().CloseIdleConnections)
	req, err := http.NewRequest(http.MethodGet, b.URLString+"/v1/models", nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	resp, err := b.Client().Do(req)
	if err != nil {
		return err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return errors.New(resp.Status)
	}
	return nil
}

func TestHTTPSBackendIsVerifiedAgainstItsCA(t *testing.T) {
	e := newTLSEngine(t)
	for _, tc := range []struct {
		name    string
		mutate  func(*routerconfig.BackendConfig)
		wantErr string // empty: the call succeeds
		warns   bool   // a warning about skipped verification is logged
	}{
		{name: "tls_ca_file trusts the engine's certificate", mutate: func(b *routerconfig.BackendConfig) { b.TLSCAFile = e.caFile }},
		{name: "without tls_ca_file the system roots refuse a self-signed engine", mutate: func(*routerconfig.BackendConfig) {},
			wantErr: "certificate signed by unknown authority"},
		{name: "tls_server_name is checked against the certificate", mutate: func(b *routerconfig.BackendConfig) {
			b.TLSCAFile, b.TLSServerName = e.caFile, "example.com"
		}},
		{name: "a tls_server_name the certificate lacks is refused", mutate: func(b *routerconfig.BackendConfig) {
			b.TLSCAFile, b.TLSServerName = e.caFile, "engine.other.test"
		}, wantErr: "not engine.other.test"},
		{name: "tls_insecure_skip_verify accepts any certificate and says so", mutate: func(b *routerconfig.BackendConfig) { b.TLSInsecureSkipVerify = true },
			warns: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bc := routerconfig.BackendConfig{Name: "d0", URL: e.URL, Role: routerconfig.RoleDecode}
			tc.mutate(&bc)
			core, logs := observer.New(zapcore.WarnLevel)
			r, err := New(routerconfig.Config{Backends: []routerconfig.BackendConfig{bc}, Health: routerconfig.HealthConfig{Interval: -1}}, zap.New(core), prometheus.NewRegistry())
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			err = get(t, backendByName(t, r, "d0"), nil)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("call: %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("call error = %v, want one containing %q", err, tc.wantErr)
			}
			warned := logs.FilterMessageSnippet("tls certificate verification is off").FilterField(zap.String("backend", "d0")).Len() == 1
			if warned != tc.warns {
				t.Errorf("warning about skipped verification logged = %v, want %v (logs: %v)", warned, tc.warns, logs.All())
			}
		})
	}
}

func TestBackendAPIKeyReplacesTheClientsKey(t *testing.T) {
	e := newTLSEngine(t)
	t.Setenv("PDPROXY_TEST_ENGINE_KEY", "engine-key-from-env")
	for _, tc := range []struct {
		name   string
		mutate func(*routerconfig.BackendConfig)
		sent   http.Header
		want   string
	}{
		{name: "api_key is sent as a bearer token", mutate: func(b *routerconfig.BackendConfig) { b.APIKey = "engine-key" },
			want: "Bearer engine-key"},
		{name: "api_key replaces the Authorization the request carried", mutate: func(b *routerconfig.BackendConfig) { b.APIKey = "engine-key" },
			sent: http.Header{"Authorization": {"Bearer client-key"}}, want: "Bearer engine-key"},
		{name: "api_key_env reads the key from the environment", mutate: func(b *routerconfig.BackendConfig) { b.APIKeyEnv = "PDPROXY_TEST_ENGINE_KEY" },
			want: "Bearer engine-key-from-env"},
		{name: "without a key the request's Authorization is left as it is", mutate: func(*routerconfig.BackendConfig) {},
			sent: http.Header{"Authorization": {"Bearer client-key"}}, want: "Bearer client-key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bc := routerconfig.BackendConfig{Name: "d0", URL: e.URL, Role: routerconfig.RoleDecode, TLSCAFile: e.caFile}
			tc.mutate(&bc)
			r, _, _ := newTestRouter(t, routerconfig.Config{Backends: []routerconfig.BackendConfig{bc}})
			b := backendByName(t, r, "d0")
			before := tc.sent.Clone()
			if err := get(t, b, tc.sent); err != nil {
				t.Fatalf("call: %v", err)
			}
			if got := <-e.auth; got != tc.want {
				t.Errorf("engine got Authorization %q, want %q", got, tc.want)
			}
			if tc.sent.Get("Authorization") != before.Get("Authorization") {
				t.Error("the caller's request was modified")
			}
		})
	}
}

func TestBackendSecurityConfigErrorsNameTheField(t *testing.T) {
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	if err := os.WriteFile(notPEM, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		bc   routerconfig.BackendConfig
		want string
	}{
		{"tls_ca_file on an http url", routerconfig.BackendConfig{URL: "http://d:1", TLSCAFile: notPEM}, "backends[0].tls_ca_file: set, but the url"},
		{"tls_server_name on an http url", routerconfig.BackendConfig{URL: "http://d:1", TLSServerName: "d"}, "backends[0].tls_server_name: set, but the url"},
		{"tls_insecure_skip_verify on an http url", routerconfig.BackendConfig{URL: "http://d:1", TLSInsecureSkipVerify: true}, "backends[0].tls_insecure_skip_verify: set, but the url"},
		{"skip verify together with a CA", routerconfig.BackendConfig{URL: "https://d:1", TLSCAFile: notPEM, TLSInsecureSkipVerify: true}, "backends[0].tls_insecure_skip_verify: contradicts tls_ca_file"},
		{"both api_key and api_key_env", routerconfig.BackendConfig{URL: "http://d:1", APIKey: "k", APIKeyEnv: "K"}, "backends[0].api_key_env: set together with api_key"},
		{"a missing CA file", routerconfig.BackendConfig{URL: "https://d:1", TLSCAFile: filepath.Join(dir, "missing.pem")}, "backends[0].tls_ca_file: open"},
		{"a CA file with no certificate", routerconfig.BackendConfig{URL: "https://d:1", TLSCAFile: notPEM}, "backends[0].tls_ca_file: " + notPEM + " holds no PEM certificate"},
		{"an unset key variable", routerconfig.BackendConfig{URL: "http://d:1", APIKeyEnv: "PDPROXY_TEST_UNSET_KEY"}, "backends[0].api_key_env: environment variable PDPROXY_TEST_UNSET_KEY is unset or empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.bc.Name, tc.bc.Role = "d0", routerconfig.RoleDecode
			_, err := New(routerconfig.Config{Backends: []routerconfig.BackendConfig{tc.bc}}, nil, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestReloadRebuildsTheClientOnlyWhenItsSecuritySettingsChange(t *testing.T) {
	e := newTLSEngine(t)
	cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "d0", URL: e.URL, Role: routerconfig.RoleDecode, TLSCAFile: e.caFile, APIKey: "k1"}}}
	r, _, _ := newTestRouter(t, cfg)
	first := backendByName(t, r, "d0").Client()

	cfg.Health.Interval = -1
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if backendByName(t, r, "d0").Client() != first {
		t.Error("an unchanged reload replaced the client (and dropped its warm connections)")
	}
	cfg.Backends[0].APIKey = "k2"
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	b := backendByName(t, r, "d0")
	if b.Client() == first {
		t.Fatal("a new api_key kept the old client")
	}
	if err := get(t, b, nil); err != nil {
		t.Fatal(err)
	}
	if got := <-e.auth; got != "Bearer k2" {
		t.Errorf("after the reload the engine got %q, want the new key", got)
	}
	// A rotated CA file under the same name is noticed too (a bundle with one more
	// certificate: httptest has a single one to offer).
	data, err := os.ReadFile(e.caFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.caFile, append(data, data...), 0o600); err != nil {
		t.Fatal(err)
	}
	before := b.Client()
	if err := r.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if backendByName(t, r, "d0").Client() == before {
		t.Error("a changed CA file kept the old client")
	}
}
