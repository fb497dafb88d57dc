package redistest

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestAServerStopsAndStartsAgainOnItsPortEmpty(t *testing.T) {
	s := Start(t)
	addr := s.Addr()
	if _, err := s.Do("SET", "k", "v"); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := s.Do("DBSIZE"); err != nil || got != ":1" {
		t.Fatalf("DBSIZE = %q, %v; want :1", got, err)
	}
	s.Stop()
	if _, err := s.Do("PING"); err == nil {
		t.Fatal("a stopped server answered PING")
	}
	s.Restart()
	if s.Addr() != addr {
		t.Fatalf("restarted on %s, want %s", s.Addr(), addr)
	}
	if got, err := s.Do("DBSIZE"); err != nil || got != ":0" {
		t.Fatalf("DBSIZE after a restart = %q, %v; want :0 (nothing persisted)", got, err)
	}
}

func TestAPausedServerAnswersNothingUntilResumed(t *testing.T) {
	s := Start(t)
	s.Pause()
	if err := ping(s.Addr()); err == nil {
		t.Fatal("a paused server answered PING")
	}
	s.Resume()
	if err := ping(s.Addr()); err != nil {
		t.Fatalf("PING after Resume: %v", err)
	}
	s.Pause() // the cleanup kills a paused server too
}
