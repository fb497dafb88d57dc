package engine

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func TestParseFieldsRefusesWhatIsNoObject(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		check      func(error) bool
	}{
		{"truncated JSON: the error encoding/json gives", `{"model":"m"`, func(err error) bool { var se *json.SyntaxError; return errors.As(err, &se) }},
		{"a syntax error: the error encoding/json gives", `{"model" "m"}`, func(err error) bool { var se *json.SyntaxError; return errors.As(err, &se) }},
		{"an array", `[{"model":"m"}]`, func(err error) bool { var te *json.UnmarshalTypeError; return errors.As(err, &te) }},
		{"a string", `"model"`, func(err error) bool { var te *json.UnmarshalTypeError; return errors.As(err, &te) }},
		{"null", ` null `, func(err error) bool { return errors.Is(err, ErrNullBody) }},
		{"nothing", ``, func(err error) bool { return err != nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := ParseFields([]byte(tc.body))
			if f != nil || !tc.check(err) {
				t.Fatalf("ParseFields(%q) = %v, %v", tc.body, f, err)
			}
		})
	}
}

func TestFieldsReadLikeEncodingJSON(t *testing.T) {
	body := " {\n \"model\" : \"m\" ,\"str\\u0065am\":true, \"prompt\":\"a \\\"quoted\\\" {brace} [and] \\\\\",\"n\":[1,{\"x\":\"}\"}],\n" +
		"\"max_tokens\":5,\"max_tokens\":7 ,\"e\":-1.5e+3,\"t\":true,\"z\":null, \"o\":{} } \n"
	f := parseFields(t, body)
	var want map[string]json.RawMessage
	if err := json.Unmarshal([]byte(body), &want); err != nil {
		t.Fatal(err)
	}
	for k, v := range want {
		got, ok := f.Field(k)
		if !ok || !bytes.Equal(got, v) {
			t.Errorf("Field(%q) = %s, %v; encoding/json reads %s", k, got, ok, v)
		}
	}
	if got, _ := f.Field("max_tokens"); string(got) != "7" {
		t.Errorf("a duplicated key reads %s, want its last value 7", got)
	}
	if _, ok := f.Field("absent"); ok {
		t.Error("Field found a key the body does not have")
	}
	if f.Len() != 10 {
		t.Errorf("Len = %d, want 10 members, duplicates included", f.Len())
	}
	n := 0
	for k := range f.All() {
		if _, ok := want[k]; !ok {
			t.Errorf("All yielded %q, which the body does not have", k)
		}
		n++
	}
	if n != 10 {
		t.Errorf("All yielded %d members, want 10", n)
	}
}

func TestRewritesChangeOnlyWhatTheyMust(t *testing.T) {
	t.Run("a decode without params is the client's body itself, not a copy", func(t *testing.T) {
		body := []byte(`{"model":"m", "prompt":"p"}`)
		f, err := ParseFields(body)
		if err != nil {
			t.Fatal(err)
		}
		out, err := DecodeBody(f, nil)
		if err != nil || &out[0] != &body[0] || len(out) != len(body) {
			t.Fatalf("DecodeBody = %q, %v; want the client's bytes", out, err)
		}
	})
	t.Run("a decode with params appends them to the client's bytes", func(t *testing.T) {
		out, err := DecodeBody(parseFields(t, "{\"model\": \"m\",\n \"prompt\":\"p\" }\n"), json.RawMessage(`{"a": 1}`))
		if want := "{\"model\": \"m\",\n \"prompt\":\"p\" ,\"kv_transfer_params\":{\"a\": 1}}"; err != nil || string(out) != want {
			t.Fatalf("DecodeBody = %q, %v; want %q", out, err, want)
		}
	})
	t.Run("params go into an empty object without a comma", func(t *testing.T) {
		out, err := DecodeBody(parseFields(t, `{ }`), json.RawMessage(`{}`))
		if err != nil || string(out) != `{ "kv_transfer_params":{}}` {
			t.Fatalf("DecodeBody = %q, %v", out, err)
		}
	})
	t.Run("the client's own kv_transfer_params never pass, even written with escapes", func(t *testing.T) {
		out, err := DecodeBody(parseFields(t, `{"model":"m","kv_transfer_p\u0061rams":{"remote_host":"evil"}}`), nil)
		if err != nil || string(out) != `{"model":"m"}` {
			t.Fatalf("DecodeBody = %q, %v", out, err)
		}
	})
	t.Run("a duplicated key passes on once, with the value the proxy validated", func(t *testing.T) {
		out, err := DecodeBody(parseFields(t, `{"model":"a","n":1,"model":"b"}`), nil)
		if err != nil || string(out) != `{"n":1,"model":"b"}` {
			t.Fatalf("DecodeBody = %q, %v", out, err)
		}
	})
	t.Run("params that are not JSON are refused", func(t *testing.T) {
		if _, err := DecodeBody(parseFields(t, `{"model":"m"}`), json.RawMessage(`{"a":`)); !errors.Is(err, ErrBadKVParams) {
			t.Fatalf("error %v, want ErrBadKVParams", err)
		}
	})
	t.Run("a prefill keeps the client's members byte for byte and sets its own last", func(t *testing.T) {
		out, err := PrefillBody(parseFields(t, `{"model":"m","stream":true,"prompt":"x\u00e9 <&>","max_tokens":9,"temperature":0.50}`), APICompletions)
		want := `{"model":"m","prompt":"x\u00e9 <&>","temperature":0.50,"kv_transfer_params":` + string(prefillParams) + `,"stream":false,"max_tokens":1}`
		if err != nil || string(out) != want {
			t.Fatalf("PrefillBody =\n %s, %v; want\n %s", out, err, want)
		}
	})
}

// rewriteOracle is what a rewrite means, on the body as encoding/json reads it: drop the keys,
// then set the members.
func rewriteOracle(in map[string]json.RawMessage, drop []string, add ...set) map[string]json.RawMessage {
	out := make(map[string]json.RawMessage, len(in)+len(add))
	for k, v := range in {
		out[k] = v
	}
	for _, k := range drop {
		delete(out, k)
	}
	for _, a := range add {
		out[a.key] = json.RawMessage(a.val)
	}
	return out
}

// FuzzRewrites: for any body ParseFields takes, Field reads what encoding/json reads, and each
// rewrite is a JSON object that means what rewriting the decoded object would mean.
func FuzzRewrites(f *testing.F) {
	for _, seed := range []string{
		completionBody, chatBody, `{}`, ` { } `, `{"a":1,"a":2}`, `{"stream":true,"str\u0065am":false}`,
		`{"kv_transfer_params":null,"model":"m"}`, `{"s":"\\\"}{][","t":[{"u":"\""}]}`,
		"{\"a\"\n:\n[ 1 , 2 ]\n,\"b\":{\"c\":{}}}", `{"n":-0.5e-7,"x":true,"y":false,"z":null}`,
		`[]`, `null`, `{"a":`, `{"a" 1}`, "{\"a\":\"\xff\"}", strings.Repeat(`{"k":`, 20) + `1` + strings.Repeat(`}`, 20),
	} {
		f.Add([]byte(seed), false)
		f.Add([]byte(seed), true)
	}
	params := json.RawMessage(`{"do_remote_prefill":true, "remote_block_ids":[1,2]}`)
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		var want map[string]json.RawMessage
		wantErr := json.Unmarshal(body, &want)
		fields, err := ParseFields(bytes.Clone(body))
		if (err != nil) != (wantErr != nil || want == nil) {
			t.Fatalf("ParseFields(%q) error %v; encoding/json says %v, %v", body, err, want, wantErr)
		}
		if err != nil {
			return
		}
		for k, v := range want {
			if got, ok := fields.Field(k); !ok || !bytes.Equal(got, v) {
				t.Fatalf("Field(%q) = %q, %v; encoding/json reads %q in %q", k, got, ok, v, body)
			}
		}
		pre, prefillDropped := prefillDrop, []set{{"kv_transfer_params", prefillParams}, {"stream", rawFalse}, {"max_tokens", rawOne}}
		drain, drainSet := drainDrop, []set{{"kv_transfer_params", params}, {"stream", rawFalse}, {"max_tokens", rawOne}}
		if chat {
			pre, drain = prefillDropChat, drainDropChat
			prefillDropped = append(prefillDropped, set{"max_completion_tokens", rawOne})
			drainSet = append(drainSet, set{"max_completion_tokens", rawOne})
		}
		check := func(name string, out []byte, err error, wantOut map[string]json.RawMessage) {
			t.Helper()
			if err != nil {
				t.Fatalf("%s of %q: %v", name, body, err)
			}
			var got map[string]json.RawMessage
			if err := json.Unmarshal(out, &got); err != nil || got == nil {
				t.Fatalf("%s of %q is %q, not a JSON object: %v", name, body, out, err)
			}
			if len(got) != len(wantOut) {
				t.Fatalf("%s of %q is %q, want the members %q", name, body, out, wantOut)
			}
			for k, v := range wantOut {
				if !bytes.Equal(got[k], v) {
					t.Fatalf("%s of %q: %s = %q, want %q", name, body, k, got[k], v)
				}
			}
			if n := bytes.Count(out, []byte(`"kv_transfer_params"`)); n > 1 {
				t.Fatalf("%s of %q carries kv_transfer_params %d times: %q", name, body, n, out)
			}
		}
		api := APICompletions
		if chat {
			api = APIChat
		}
		out, err := PrefillBody(fields, api)
		check("PrefillBody", out, err, rewriteOracle(want, pre, prefillDropped...))
		out, err = DecodeBody(fields, params)
		check("DecodeBody", out, err, rewriteOracle(want, decodeDrop, set{"kv_transfer_params", params}))
		out, err = DecodeBody(fields, nil)
		check("DecodeBody without params", out, err, rewriteOracle(want, decodeDrop))
		out, err = DrainBody(fields, api, params)
		check("DrainBody", out, err, rewriteOracle(want, drain, drainSet...))
	})
}
