package e2e

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/pdproxy/pdproxy/sim"
)

// privateCA makes a CA and a server certificate it signs for name only (no IP address), so
// that an engine reached by IP verifies only with tls_server_name set. It returns the
// server certificate and the CA as a PEM file.
func privateCA(t *testing.T, name string) (tls.Certificate, string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "pdproxy e2e engine CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{name},
	}, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(t.TempDir(), "engine-ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{leafDER}, PrivateKey: key}, caFile
}

// keyedTLSSimDecoder runs a simulated decoder serving model behind TLS with a certificate for
// serverName from its own CA, and, like vLLM's --api-key, refuses /v1/ calls without
// "Authorization: Bearer apiKey". It returns the engine (its URL by IP) and the CA file.
func keyedTLSSimDecoder(t *testing.T, model, serverName, apiKey string) (srv *httptest.Server, caFile string) {
	t.Helper()
	cfg := sim.DefaultConfig()
	cfg.Role = "decode"
	cfg.Model = model
	cfg.ITL = time.Millisecond
	eng, err := sim.New(cfg, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(ctx) }()
	h := eng.Handler()
	srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/") && r.Header.Get("Authorization") != "Bearer "+apiKey {
			http.Error(w, `{"error":"Unauthorized"}`, http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	}))
	cert, caFile := privateCA(t, serverName)
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	srv.StartTLS()
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("sim engine: %v", err)
		}
	})
	return srv, caFile
}

func TestModelsFromATLSEngineWithItsOwnCAAndKey(t *testing.T) {
	const model, serverName, apiKey = "engine-behind-tls", "engine.internal", "sk-engine-key"
	engine, caFile := keyedTLSSimDecoder(t, model, serverName, apiKey)
	if !strings.HasPrefix(engine.URL, "https://127.0.0.1:") {
		t.Fatalf("engine URL %q, want https by IP", engine.URL)
	}
	s := startStack(t, func(c *app.Config) {
		c.Sims = nil
		c.Router.Backends = []routerconfig.BackendConfig{{
			Name: "tls-decode", URL: engine.URL, Role: routerconfig.RoleDecode, Engine: "sim",
			TLSCAFile: caFile, TLSServerName: serverName, APIKey: apiKey,
		}}
	})

	t.Run("a completion is served", func(t *testing.T) {
		status, _, body := secRequest(t, http.DefaultClient, http.MethodPost, s.url+"/v1/completions",
			`{"model":"`+model+`","prompt":"hello","max_tokens":3}`, "")
		if status != http.StatusOK {
			t.Fatalf("status %d, want 200: %s", status, body)
		}
	})
	t.Run("/v1/models lists the engine's model", func(t *testing.T) {
		status, _, body := secRequest(t, http.DefaultClient, http.MethodGet, s.url+"/v1/models", "", "")
		var list struct {
			Object string `json:"object"`
			Data   []struct {
				ID string `json:"id"`
			} `json:"data"`
		}
		if status != http.StatusOK || json.Unmarshal(body, &list) != nil || list.Object != "list" ||
			len(list.Data) != 1 || list.Data[0].ID != model {
			t.Fatalf("GET /v1/models: %d %s, want 200 listing %q", status, body, model)
		}
	})
}
