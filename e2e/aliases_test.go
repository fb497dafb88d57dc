package e2e

import (
	"context"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
)

// twoModels runs two P/D pairs of the simulator, one serving v1 and one v2, with an alias
// "chat" for v1 and a canary "canary" sending 90% to v1 and 10% to v2.
func twoModels(c *app.Config) {
	fastSims(c)
	withSecondPair(c)
	c.Sims[0].Model, c.Sims[1].Model = "v1", "v1"
	c.Sims[2].Model, c.Sims[3].Model = "v2", "v2"
	ninety, ten := 90, 10
	c.Proxy.ModelAliases = map[string]proxy.Alias{
		"chat":   {{Model: "v1"}},
		"canary": {{Model: "v1", Weight: &ninety}, {Model: "v2", Weight: &ten}},
	}
}

// waitForModels waits until every engine has listed its models to the proxy (its first
// health check): until then a request may reach an engine of another model.
func waitForModels(t *testing.T, s *stack) {
	t.Helper()
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		for _, b := range s.m.Router.Backends() {
			if len(b.Models) == 0 {
				return false, b.Name + " has listed no models yet"
			}
		}
		return true, ""
	})
}

func TestModelsAliasesAndCanariesThroughTheSDK(t *testing.T) {
	s := startStack(t, twoModels)
	waitForModels(t, s)
	client := openai.NewClient(option.WithBaseURL(s.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0),
		option.WithJSONSet("ignore_eos", true))
	ctx := context.Background()
	chat := func(model string) (*openai.ChatCompletion, error) {
		return client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model: model, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")}, MaxTokens: openai.Int(3),
		})
	}
	decoders := s.m.SimURLs("decode") // v1's, then v2's
	served := func() (v1, v2 int) { return kv(t, decoders[0]).RequestsTotal, kv(t, decoders[1]).RequestsTotal }

	t.Run("a model nobody serves is a 404 model_not_found, and no engine is asked", func(t *testing.T) {
		v1, v2 := served()
		_, err := chat("llama-3-405b")
		var apiErr *openai.Error
		if !asOpenAIError(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound || apiErr.Code != "model_not_found" || apiErr.Param != "model" {
			t.Fatalf("want a 404 model_not_found on param model, got %v", err)
		}
		if a, b := served(); a != v1 || b != v2 {
			t.Fatalf("engines served %d and %d requests for a model they do not serve", a-v1, b-v2)
		}
	})

	t.Run("/v1/models lists every served model and alias once", func(t *testing.T) {
		page, err := client.Models.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, m := range page.Data {
			ids = append(ids, m.ID)
		}
		slices.Sort(ids)
		if want := []string{"canary", "chat", "v1", "v2"}; !slices.Equal(ids, want) {
			t.Fatalf("/v1/models lists %v, want %v", ids, want)
		}
	})

	t.Run("an alias is served by its model and answers under the client's name", func(t *testing.T) {
		v1, v2 := served()
		resp, err := chat("chat")
		if err != nil {
			t.Fatal(err)
		}
		if resp.Model != "chat" {
			t.Fatalf("answer names model %q, want the alias the client used", resp.Model)
		}
		if a, b := served(); a != v1+1 || b != v2 {
			t.Fatalf("v1 served %d, v2 %d; want the alias on v1 only", a-v1, b-v2)
		}
		stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
			Model: "chat", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("stream")}, MaxTokens: openai.Int(5),
		})
		chunks := 0
		for stream.Next() {
			if m := stream.Current().Model; m != "chat" {
				t.Fatalf("stream chunk names model %q", m)
			}
			chunks++
		}
		if err := stream.Err(); err != nil || chunks < 2 {
			t.Fatalf("stream: %d chunks, %v", chunks, err)
		}
	})

	t.Run("a 90/10 canary splits 300 requests exactly 270/30", func(t *testing.T) {
		v1, v2 := served()
		const n = 300
		for i := range n {
			resp, err := chat("canary")
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
			if resp.Model != "canary" {
				t.Fatalf("answer names model %q", resp.Model)
			}
		}
		a, b := served()
		got1, got2 := a-v1, b-v2
		if got1+got2 != n {
			t.Fatalf("engines served %d+%d requests, want %d", got1, got2, n)
		}
		// Smooth weighted round robin gives each target exactly its weight in every run of
		// 100 picks: 300 picks are 270 and 30, not merely about that.
		if got1 != 270 || got2 != 30 {
			t.Fatalf("v1 took %d and v2 %d of %d, want exactly 270 and 30", got1, got2, n)
		}
	})

	t.Run("metrics carry the client's model, and anything else is other", func(t *testing.T) {
		if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"model": "canary", "code": "200"}); got != 300 {
			t.Errorf(`pdproxy_requests_total{model="canary",code="200"} = %v, want 300`, got)
		}
		if got := testutil.Value(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"model": "other", "code": "404"}); got != 1 {
			t.Errorf(`pdproxy_requests_total{model="other",code="404"} = %v, want 1: the unknown model`, got)
		}
		if _, present := testutil.Lookup(t, s.m.Registry, "pdproxy_requests_total", map[string]string{"model": "llama-3-405b"}); present {
			t.Error("a model nobody serves became a label value")
		}
	})
	s.assertQuiet(time.Second)
}
