package sim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"
)

// shutdownGrace bounds how long Close (and so RunCommand) waits for
// in-flight responses.
const shutdownGrace = 10 * time.Second

// Server is a simulated engine as a process sees it: an Engine with its
// scheduler running and an HTTP server on one address. It is what can
// crash: the die-after fault (X-Sim-Die-After, --die-after) kills it as a
// crashed process dies, every open connection closed at once (streams cut
// mid-answer, no [DONE], no error event), the listener gone (new
// connections are refused) and the KV with it. Restart brings a new engine
// up on the same address, empty as a new process: no cache, no holds, a
// new engine id unless Config.EngineID names one.
type Server struct {
	cfg  Config
	log  *zap.Logger
	addr string // where every incarnation listens: the first's bound address

	mu   sync.Mutex
	life *life
}

// life is one incarnation of a Server's engine.
type life struct {
	eng    *Engine
	srv    *http.Server
	cancel context.CancelFunc
	wg     sync.WaitGroup
	errs   [2]error // Run's and Serve's
	died   chan struct{}
	once   sync.Once // closes died
}

// NewServer runs an engine of cfg on ln until Close; Restart listens again
// on ln's address.
func NewServer(cfg Config, ln net.Listener, logger *zap.Logger) (*Server, error) {
	if logger == nil {
		logger = zap.NewNop()
	}
	s := &Server{cfg: cfg, log: logger, addr: ln.Addr().String()}
	l, err := s.start(ln)
	if err != nil {
		ln.Close()
		return nil, err
	}
	s.life = l
	return s, nil
}

// Listen is NewServer on a listener bound to addr (port 0 picks one).
func Listen(cfg Config, addr string, logger *zap.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("sim: listen %s: %w", addr, err)
	}
	return NewServer(cfg, ln, logger)
}

func (s *Server) start(ln net.Listener) (*life, error) {
	eng, err := New(s.cfg, s.log)
	if err != nil {
		return nil, err
	}
	l := &life{eng: eng, died: make(chan struct{})}
	for _, r := range eng.ranks {
		r.die = func() { s.kill(l) }
	}
	l.srv = &http.Server{Handler: eng.Handler(), ReadHeaderTimeout: 10 * time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	l.wg.Go(func() { l.errs[0] = eng.Run(ctx) })
	l.wg.Go(func() {
		if err := l.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			l.errs[1] = fmt.Errorf("sim: serve: %w", err)
		}
	})
	return l, nil
}

// kill is l's crash: connections and listener first, so that no handler
// answers anything once the engine's requests end, then the engine.
func (s *Server) kill(l *life) {
	l.once.Do(func() {
		s.log.Warn("sim engine died", zap.String("addr", s.addr), zap.String("engine_id", l.eng.ID()))
		_ = l.srv.Close()
		l.cancel()
		close(l.died)
	})
}

// URL is the server's base URL, http://host:port.
func (s *Server) URL() string { return "http://" + s.addr }

// Addr is the address the server listens on, the same for every restart.
func (s *Server) Addr() string { return s.addr }

// Engine is the running incarnation's engine.
func (s *Server) Engine() *Engine {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.life.eng
}

// Died is closed when the running incarnation dies (by the die-after fault
// or Kill); a Restart's incarnation has a new one.
func (s *Server) Died() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.life.died
}

// Kill crashes the engine now, as the die-after fault does.
func (s *Server) Kill() {
	s.mu.Lock()
	l := s.life
	s.mu.Unlock()
	s.kill(l)
}

// Restart kills the engine if it still runs, waits for it to be gone and
// starts a new one on the same address.
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.kill(s.life)
	s.life.wg.Wait()
	ln, err := net.Listen("tcp", s.addr)
	if err != nil {
		return fmt.Errorf("sim: restart on %s: %w", s.addr, err)
	}
	l, err := s.start(ln)
	if err != nil {
		ln.Close()
		return err
	}
	s.life = l
	return nil
}

// Close stops the engine, gracefully unless it died: its requests end (a
// 503 engine_stopped for those still running), the in-flight responses get
// up to shutdownGrace to be written. It returns the engine's and the HTTP
// server's errors.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.life
	l.cancel() // the engine ends every request, so handlers return promptly
	sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	if err := l.srv.Shutdown(sctx); err != nil {
		_ = l.srv.Close()
	}
	l.wg.Wait()
	l.eng.CloseIdleConnections()
	return errors.Join(l.errs[:]...)
}
