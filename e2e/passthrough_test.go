package e2e

import (
	"bytes"
	"context"
	"fmt"
	"hash/fnv"
	"net/http"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/pdproxy/pdproxy/internal/testutil"
)

// The routes one engine answers without P/D, through the official Go SDK against the
// simulator: two models, an alias "chat" for v1 (twoModels).
func TestEmbeddingsAndTranscriptionsThroughTheSDK(t *testing.T) {
	s := startStack(t, twoModels)
	waitForModels(t, s)
	client := openai.NewClient(option.WithBaseURL(s.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx := context.Background()
	decoders := s.m.SimURLs("decode") // v1's, then v2's
	pooled := func() (v1, v2 int) {
		return kv(t, decoders[0]).PoolingRequestsTotal, kv(t, decoders[1]).PoolingRequestsTotal
	}

	t.Run("embeddings of an alias come from its model's engine, under the client's name", func(t *testing.T) {
		v1, v2 := pooled()
		resp, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{
			Model: "chat", Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"hello there", "general kenobi"}},
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Data) != 2 || len(resp.Data[0].Embedding) != 16 || len(resp.Data[1].Embedding) != 16 {
			t.Fatalf("want two vectors of 16, got %+v", resp.Data)
		}
		if resp.Model != "chat" {
			t.Errorf("answer names model %q, want the alias the client used", resp.Model)
		}
		if a, b := pooled(); a != v1+1 || b != v2 {
			t.Errorf("v1's engine served %d, v2's %d; want 1 and 0", a-v1, b-v2)
		}
	})

	t.Run("embeddings for a model nobody serves are a 404 that reaches no engine", func(t *testing.T) {
		v1, v2 := pooled()
		_, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{
			Model: "text-embedding-3-large", Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("x")},
		})
		var apiErr *openai.Error
		if !asOpenAIError(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound || apiErr.Code != "model_not_found" {
			t.Fatalf("want a 404 model_not_found, got %v", err)
		}
		if a, b := pooled(); a != v1 || b != v2 {
			t.Errorf("engines served %d and %d requests for a model they do not serve", a-v1, b-v2)
		}
	})

	t.Run("a transcription's file reaches the engine byte for byte", func(t *testing.T) {
		audio := make([]byte, 100<<10)
		for i := range audio {
			audio[i] = byte(i * 31)
		}
		v1, _ := pooled()
		resp, err := client.Audio.Transcriptions.New(ctx, openai.AudioTranscriptionNewParams{
			Model: "chat", File: openai.File(bytes.NewReader(audio), "speech.wav", "audio/wav"),
		})
		if err != nil {
			t.Fatal(err)
		}
		h := fnv.New64a()
		h.Write(audio)
		if want := fmt.Sprintf("sim transcription of %d bytes %016x", len(audio), h.Sum64()); resp.Text != want {
			t.Errorf("transcript %q, want %q (the engine's hash of the file)", resp.Text, want)
		}
		if a, _ := pooled(); a != v1+1 {
			t.Errorf("v1's engine served %d transcriptions, want 1", a-v1)
		}
	})

	t.Run("a client leaving an embedding stops it on the engine", func(t *testing.T) {
		before := kv(t, decoders[0])
		ctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			resp, err := http.DefaultClient.Do(mustRequest(t, ctx, s.url+"/v1/embeddings", `{"model":"v1","input":"slow"}`, "X-Sim-Stall", "10s"))
			if err == nil {
				resp.Body.Close()
				t.Errorf("the client that left got status %d", resp.StatusCode)
			}
		}()
		testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
			n := kv(t, decoders[0]).PoolingRequestsTotal - before.PoolingRequestsTotal
			return n == 1, fmt.Sprintf("the engine took %d requests", n)
		})
		cancel()
		<-done
		testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
			n := kv(t, decoders[0]).PoolingAbortedTotal - before.PoolingAbortedTotal
			return n == 1, fmt.Sprintf("the engine stopped %d requests", n)
		})
	})
	s.assertQuiet(2 * time.Second)
}

func mustRequest(t *testing.T, ctx context.Context, url, body string, hdr ...string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader([]byte(body)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return req
}
