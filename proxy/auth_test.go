package proxy

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/api"
)

// keysFile writes a keys file and returns its path.
func keysFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

const completion = `{"model":"m","prompt":"hi","max_tokens":2}`

func bearer(key string) http.Header { return http.Header{"Authorization": {"Bearer " + key}} }

func TestAPIKeysComeFromAFileAndAnEnvironmentVariable(t *testing.T) {
	file := keysFile(t, "# team a\nkey-a1\n\n   key-a2  \n# key-retired\n")
	t.Setenv("PDPROXY_TEST_KEYS", " key-e1, key-e2 ,,")
	for _, tc := range []struct {
		name     string
		cfg      Config
		accepted []string
		refused  []string
	}{
		{name: "a file: one key a line, blanks and # comments skipped, spaces trimmed",
			cfg: Config{APIKeysFile: file}, accepted: []string{"key-a1", "key-a2"}, refused: []string{"key-retired", "# team a", "key-e1"}},
		{name: "an environment variable: comma separated, spaces trimmed",
			cfg: Config{APIKeysEnv: "PDPROXY_TEST_KEYS"}, accepted: []string{"key-e1", "key-e2"}, refused: []string{"key-a1", "key-e1, key-e2", "key-e1,"}},
		{name: "both: the keys of either are accepted",
			cfg: Config{APIKeysFile: file, APIKeysEnv: "PDPROXY_TEST_KEYS"}, accepted: []string{"key-a1", "key-e2"}, refused: []string{"key-a", "key-e"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newEngine(t, vllmDecode)
			h := aggregated(t, tc.cfg, d)
			for _, k := range tc.accepted {
				if got := h.statusOf(completion, bearer(k)); got != http.StatusOK {
					t.Errorf("key %q: status %d, want 200", k, got)
				}
			}
			for _, k := range tc.refused {
				if got := h.statusOf(completion, bearer(k)); got != http.StatusUnauthorized {
					t.Errorf("key %q: status %d, want 401", k, got)
				}
			}
			if n := len(d.generations()); n != len(tc.accepted) {
				t.Errorf("the decoder got %d calls, want %d: one per accepted key, none for a refused one", n, len(tc.accepted))
			}
		})
	}
}

func TestRequestsWithoutAValidKeyGet401AndReachNoBackend(t *testing.T) {
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	h := pd(t, Config{APIKeysFile: keysFile(t, "the-key\n")}, p, d)
	for _, tc := range []struct {
		name, method, path, auth string
		route                    string // the route label the 401 is counted under
		missing                  bool
	}{
		{name: "no Authorization header", method: "POST", path: "/v1/completions", route: "/v1/completions", missing: true},
		{name: "a wrong key", method: "POST", path: "/v1/completions", auth: "Bearer not-the-key", route: "/v1/completions"},
		{name: "the key with a suffix", method: "POST", path: "/v1/chat/completions", auth: "Bearer the-key2", route: "/v1/chat/completions"},
		{name: "a prefix of the key", method: "POST", path: "/v1/completions", auth: "Bearer the-ke", route: "/v1/completions"},
		{name: "the key under another scheme", method: "POST", path: "/v1/completions", auth: "Basic the-key", route: "/v1/completions", missing: true},
		{name: "the key with no scheme", method: "POST", path: "/v1/completions", auth: "the-key", route: "/v1/completions", missing: true},
		{name: "an empty bearer token", method: "POST", path: "/v1/completions", auth: "Bearer ", route: "/v1/completions", missing: true},
		{name: "the model list", method: "GET", path: "/v1/models", route: "/v1/models", missing: true},
		{name: "the request table", method: "GET", path: "/debug/requests", route: "/debug/requests", missing: true},
		{name: "the backend list", method: "GET", path: "/debug/backends", auth: "Bearer nope", route: "/debug/backends"},
		{name: "an unknown path, counted without its path as a label", method: "GET", path: "/v1/secret-route", route: "unmatched", missing: true},
		{name: "an open path spelled escaped", method: "GET", path: "/%68ealth", route: "unmatched", missing: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, _ := h.metric("pdproxy_requests_total", map[string]string{"route": tc.route, "code": "401"})
			hdr := http.Header{}
			if tc.auth != "" {
				hdr.Set("Authorization", tc.auth)
			}
			body := ""
			if tc.method == "POST" {
				body = completion
			}
			resp, b := h.do(tc.method, tc.path, body, hdr)
			if resp.StatusCode != http.StatusUnauthorized {
				t.Fatalf("status %d, want 401: %s", resp.StatusCode, b)
			}
			if got := resp.Header.Get("WWW-Authenticate"); got != "Bearer" {
				t.Errorf("WWW-Authenticate %q, want Bearer", got)
			}
			if got := resp.Header.Get("Content-Type"); got != "application/json" {
				t.Errorf("Content-Type %q, want application/json", got)
			}
			var e api.ErrorBody
			if err := json.Unmarshal(b, &e); err != nil {
				t.Fatalf("answer is not the OpenAI error shape: %v: %s", err, b)
			}
			if e.Error.Type != "authentication_error" || e.Error.Code != "invalid_api_key" || e.Error.Message == "" {
				t.Errorf("error = %+v, want type authentication_error, code invalid_api_key and a message", e.Error)
			}
			if strings.Contains(e.Error.Message, "missing") != tc.missing {
				t.Errorf("message %q: says a key is missing = %v, want %v", e.Error.Message, !tc.missing, tc.missing)
			}
			if strings.Contains(string(b), "the-key") {
				t.Errorf("answer leaks the key: %s", b)
			}
			after, _ := h.metric("pdproxy_requests_total", map[string]string{"route": tc.route, "code": "401"})
			if after-before != 1 {
				t.Errorf("pdproxy_requests_total{route=%q,code=401} grew by %v, want 1", tc.route, after-before)
			}
		})
	}
	if n := len(p.generations()) + len(d.generations()) + len(d.callsTo("/v1/models")); n != 0 {
		t.Errorf("backends got %d calls from refused requests, want none", n)
	}
}

func TestTheRightKeyIsServedAndNotPassedToBackends(t *testing.T) {
	p := newEngine(t, vllmPrefill(prefillerParams))
	d := newEngine(t, vllmDecode)
	h := pd(t, Config{APIKeysFile: keysFile(t, "the-key\n")}, p, d)
	for _, auth := range []string{"Bearer the-key", "bearer the-key", "BEARER   the-key  "} {
		resp, b := h.do(http.MethodPost, "/v1/completions", completion, http.Header{"Authorization": {auth}})
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("Authorization %q: status %d, want 200: %s", auth, resp.StatusCode, b)
		}
	}
	for who, calls := range map[string][]received{"prefiller": p.generations(), "decoder": d.generations()} {
		if len(calls) != 3 {
			t.Fatalf("%s got %d calls, want 3", who, len(calls))
		}
		for _, c := range calls {
			if v := c.Header.Get("Authorization"); v != "" {
				t.Errorf("%s got Authorization %q: the client's key must stay at the proxy", who, v)
			}
		}
	}
	if n, _ := h.metric("pdproxy_requests_total", map[string]string{"route": "/v1/completions", "code": "200"}); n != 3 {
		t.Errorf("pdproxy_requests_total{code=200} = %v, want 3", n)
	}
}

func TestOpenPathsAreServedWithoutAKey(t *testing.T) {
	keys := keysFile(t, "the-key\n")
	for _, tc := range []struct {
		name   string
		open   []string
		status map[string]int // path: status without a key
	}{
		{name: "by default the probes and the metrics are open", open: nil,
			status: map[string]int{"/health": 200, "/ready": 200, "/metrics": 200, "/v1/models": 401, "/debug/requests": 401}},
		{name: "auth_open_paths replaces the default list", open: []string{"/health", "/debug/backends"},
			status: map[string]int{"/health": 200, "/debug/backends": 200, "/ready": 401, "/metrics": 401}},
		{name: "an empty auth_open_paths opens nothing", open: []string{},
			status: map[string]int{"/health": 401, "/ready": 401, "/metrics": 401}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newEngine(t, vllmDecode)
			h := aggregated(t, Config{APIKeysFile: keys, AuthOpenPaths: tc.open}, d)
			for path, want := range tc.status {
				if resp, b := h.do(http.MethodGet, path, "", nil); resp.StatusCode != want {
					t.Errorf("GET %s without a key: status %d, want %d: %s", path, resp.StatusCode, want, b)
				}
			}
		})
	}
}

func TestAPIKeyConfigErrorsFailTheStart(t *testing.T) {
	empty := keysFile(t, "# nobody yet\n\n")
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"a keys file with no key", Config{APIKeysFile: empty}, "api_keys_file: " + empty + " holds no key"},
		{"a missing keys file", Config{APIKeysFile: filepath.Join(t.TempDir(), "nope")}, "api_keys_file: open"},
		{"an unset keys variable", Config{APIKeysEnv: "PDPROXY_TEST_UNSET_KEYS"}, "api_keys_env: environment variable PDPROXY_TEST_UNSET_KEYS is unset or holds no key"},
		{"an open path that is not a path", Config{APIKeysFile: keysFile(t, "k\n"), AuthOpenPaths: []string{"health"}}, `auth_open_paths: "health" does not start with /`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.cfg, nil, nil, nil, nil, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func FuzzBearerToken(f *testing.F) {
	for _, s := range []string{"Bearer k", "bearer  k ", "Basic k", "Bearer", "Bearer ", "", "BEARER\tk"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, h string) {
		tok, ok := bearerToken(h)
		if ok != (tok != "") {
			t.Fatalf("bearerToken(%q) = %q, %v: ok must say whether a token came back", h, tok, ok)
		}
		if ok && (strings.TrimSpace(tok) != tok || !strings.HasSuffix(strings.TrimSpace(h), tok)) {
			t.Fatalf("bearerToken(%q) = %q: not the trimmed end of the header", h, tok)
		}
	})
}
