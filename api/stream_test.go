package api

import "testing"

func TestStreamDone(t *testing.T) {
	for _, tc := range []struct {
		name string
		tail string
		want bool
	}{
		{"an event then [DONE] and its blank line", "data: {}\n\ndata: [DONE]\n\n", true},
		{"CRLF line ends", "data: {}\r\n\r\ndata: [DONE]\r\n\r\n", true},
		{"CR line ends", "data: [DONE]\r\r", true},
		{"no space after the colon", "data:[DONE]\n\n", true},
		{"a stream of nothing but [DONE]", "data: [DONE]\n\n", true},
		{"[DONE] without the blank line that dispatches it", "data: {}\n\ndata: [DONE]\n", false},
		{"[DONE] cut in the middle", "data: {}\n\ndata: [DO", false},
		{"the last event is a token", "data: [DONE]\n\ndata: {}\n\n", false},
		{"[DONE] inside another line", "data: {\"x\":\"data: [DONE]\n\n", false},
		{"nothing", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tail := []byte(tc.tail)
			if got := streamDone(tail[max(0, len(tail)-tailSize):]); got != tc.want {
				t.Errorf("streamDone(%q) = %v, want %v", tc.tail, got, tc.want)
			}
		})
	}
}
