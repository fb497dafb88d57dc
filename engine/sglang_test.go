package engine

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestSGLangLegBody(t *testing.T) {
	leg := Leg{Host: "10.1.2.3", Port: 8998, Room: 42, RID: "0123456789abcdef0123456789abcdef", Prompts: 1}
	for _, tc := range []struct {
		name, body string
		prompts    int
		want       map[string]string // members of the leg body, as JSON
	}{
		{name: "one prompt gets the bootstrap fields and the rid, the rest as sent",
			body: `{"model":"m","prompt":"hi","max_tokens":7,"vendor":{"x":1}}`, prompts: 1,
			want: map[string]string{"bootstrap_host": `"10.1.2.3"`, "bootstrap_port": `8998`, "bootstrap_room": `42`,
				"rid": `"0123456789abcdef0123456789abcdef"`, "max_tokens": `7`, "vendor": `{"x":1}`, "prompt": `"hi"`}},
		{name: "a client's own bootstrap fields, rid and kv params never pass",
			body: `{"model":"m","prompt":"hi","bootstrap_host":"evil","bootstrap_room":1,"rid":"x","kv_transfer_params":{}}`, prompts: 1,
			want: map[string]string{"bootstrap_host": `"10.1.2.3"`, "bootstrap_room": `42`, "rid": `"0123456789abcdef0123456789abcdef"`}},
		{name: "several prompts get one room and one prefix-free rid each",
			body: `{"model":"m","prompt":["a","b"]}`, prompts: 2,
			want: map[string]string{"bootstrap_host": `["10.1.2.3","10.1.2.3"]`, "bootstrap_port": `[8998,8998]`, "bootstrap_room": `[42,43]`,
				"rid": `["0123456789abcdef0123456789abcdef-0000","0123456789abcdef0123456789abcdef-0001"]`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := ParseFields([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			l := leg
			l.Prompts = tc.prompts
			calls, err := SGLang.Legs(f, l)
			out := calls.Prefill
			if !bytes.Equal(calls.Decode, out) {
				t.Errorf("the legs differ: %s and %s", out, calls.Decode)
			}
			if err != nil {
				t.Fatal(err)
			}
			var got map[string]json.RawMessage
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("leg body is not JSON: %v\n%s", err, out)
			}
			if _, ok := got["kv_transfer_params"]; ok {
				t.Errorf("leg body carries kv_transfer_params: %s", out)
			}
			for k, v := range tc.want {
				if string(got[k]) != v {
					t.Errorf("%s = %s, want %s (body %s)", k, got[k], v, out)
				}
			}
		})
	}
}

func TestSGLangBootstrapPortDiscovery(t *testing.T) {
	for _, tc := range []struct {
		name    string
		h       http.HandlerFunc
		want    int
		wantErr string
	}{
		{name: "server_info names the port", want: 9100, h: func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/server_info" {
				io.WriteString(w, `{"disaggregation_mode":"prefill","disaggregation_bootstrap_port":9100}`)
				return
			}
			http.NotFound(w, r)
		}},
		{name: "an older server answers on /get_server_info", want: 9200, h: func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/get_server_info" {
				io.WriteString(w, `{"disaggregation_mode":"prefill","disaggregation_bootstrap_port":9200}`)
				return
			}
			http.NotFound(w, r)
		}},
		{name: "no port named means SGLang's default", want: 8998, h: func(w http.ResponseWriter, _ *http.Request) {
			io.WriteString(w, `{"disaggregation_mode":"prefill"}`)
		}},
		{name: "a decoder is no prefiller", wantErr: "not prefill", h: func(w http.ResponseWriter, _ *http.Request) {
			io.WriteString(w, `{"disaggregation_mode":"decode","disaggregation_bootstrap_port":8998}`)
		}},
		{name: "garbage is an error", wantErr: "discover bootstrap port", h: func(w http.ResponseWriter, _ *http.Request) {
			io.WriteString(w, `<html>`)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, client, _ := fakeEngine(t, tc.h)
			bs, err := SGLang.Bootstrap(testCtx(t), client, srv.URL, 0)
			port := bs.Port
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("BootstrapPort = %d, %v; want an error saying %q", port, err, tc.wantErr)
				}
				return
			}
			if err != nil || port != tc.want {
				t.Fatalf("BootstrapPort = %d, %v; want %d", port, err, tc.want)
			}
		})
	}
}

func TestSGLangAbortIsPrefixSafeAndExplicit(t *testing.T) {
	srv, client, got := fakeEngine(t, func(http.ResponseWriter, *http.Request) {})
	if err := SGLang.(Aborter).Abort(testCtx(t), client, srv.URL, "0123456789abcdef0123456789abcdef"); err != nil {
		t.Fatal(err)
	}
	r := got()[0]
	var body struct {
		RID      string `json:"rid"`
		AbortAll *bool  `json:"abort_all"`
	}
	json.Unmarshal(r.body, &body)
	if r.path != "/abort_request" || body.RID != "0123456789abcdef0123456789abcdef" || body.AbortAll == nil || *body.AbortAll {
		t.Errorf("engine got %s %s, want /abort_request with the rid and abort_all false", r.path, r.body)
	}
}
