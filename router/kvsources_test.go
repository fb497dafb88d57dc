package router

import (
	"net/url"
	"testing"
)

func TestAKVEventSourceOnAWildcardIsDialedOnTheEnginesAddress(t *testing.T) {
	engine, _ := url.Parse("http://10.0.0.7:8000")
	tests := []struct{ reported, want string }{
		{"tcp://10.0.0.1:41001", "tcp://10.0.0.1:41001"},
		{"tcp://0.0.0.0:41001", "tcp://10.0.0.7:41001"},
		{"tcp://*:41001", "tcp://10.0.0.7:41001"},
		{"tcp://[::]:41001", "tcp://10.0.0.7:41001"},
		{"tcp://engine-0.svc:41001", "tcp://engine-0.svc:41001"},
		{"ipc:///tmp/kv", "ipc:///tmp/kv"},
	}
	for _, tt := range tests {
		if got := onEngineHost(tt.reported, engine); got != tt.want {
			t.Errorf("onEngineHost(%q) = %q, want %q", tt.reported, got, tt.want)
		}
	}
}
