package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

func TestTokenize(t *testing.T) {
	tests := []struct {
		name     string
		model    string
		prompt   string
		messages string
		status   int
		answer   string
		want     []uint32
		wantErr  bool
		wantBody map[string]any
	}{
		{name: "a completion's prompt is tokenized as a prompt", model: "m", prompt: "hello",
			want: []uint32{101, 7592, 102}, wantBody: map[string]any{"model": "m", "prompt": "hello"}},
		{name: "a chat's messages are rendered with the generation prompt", model: "m", messages: `[{"role":"user","content":"hi"}]`,
			want: []uint32{101, 7592, 102},
			wantBody: map[string]any{"model": "m", "add_generation_prompt": true,
				"messages": []any{map[string]any{"role": "user", "content": "hi"}}}},
		{name: "an engine error is an error", prompt: "x", status: 500, answer: `{"error":"boom"}`, wantErr: true},
		{name: "an answer without tokens is an error", prompt: "x", answer: `{"count":0}`, wantErr: true},
		{name: "a negative token id is an error", prompt: "x", answer: `{"tokens":[-1]}`, wantErr: true},
		{name: "an engine that does not answer before the deadline is an error", prompt: "x", answer: "hang", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var mu sync.Mutex
			var bodies []map[string]any
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				if req.URL.Path != "/tokenize" || req.Method != http.MethodPost {
					http.NotFound(w, req)
					return
				}
				var body map[string]any
				data, _ := io.ReadAll(req.Body)
				_ = json.Unmarshal(data, &body)
				mu.Lock()
				bodies = append(bodies, body)
				mu.Unlock()
				if tt.answer == "hang" {
					<-req.Context().Done()
					return
				}
				answer := tt.answer
				if answer == "" {
					answer = `{"count":3,"max_model_len":4096,"tokens":[101,7592,102]}`
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(max(tt.status, http.StatusOK))
				io.WriteString(w, answer)
			}))
			defer srv.Close()
			client := srv.Client()
			defer client.CloseIdleConnections()
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			var messages json.RawMessage
			if tt.messages != "" {
				messages = json.RawMessage(tt.messages)
			}
			got, err := Tokenizer{}.Tokenize(ctx, client, srv.URL, tt.model, tt.prompt, messages)
			if (err != nil) != tt.wantErr {
				t.Fatalf("Tokenize error = %v, want error %v", err, tt.wantErr)
			}
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("tokens = %v, want %v", got, tt.want)
			}
			if tt.wantBody != nil {
				mu.Lock()
				defer mu.Unlock()
				if len(bodies) != 1 || fmt.Sprint(bodies[0]) != fmt.Sprint(tt.wantBody) {
					t.Errorf("engine got %v, want %v", bodies, tt.wantBody)
				}
			}
		})
	}
}
