// Package redistest owns a real redis-server for tests: started on a free loopback port with
// no persistence, stopped (killed, as a crashed server), started again on the same port with
// nothing in it (as a restarted one), or paused (SIGSTOP: a server that accepts connections
// and answers nothing, as an overloaded one).
//
// It needs Debian's redis-server on PATH (apt-get install -y redis-server; .ci/run installs it
// where missing). A test that needs Redis fails without it: it is never skipped.
package redistest

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// startTimeout bounds how long a started server may take to answer PING.
const startTimeout = 10 * time.Second

// Server is one redis-server process on a loopback port that stays the same across restarts.
type Server struct {
	t    testing.TB
	bin  string
	dir  string
	port int

	mu     sync.Mutex
	cmd    *exec.Cmd // nil while stopped
	log    *os.File
	starts int
}

// Start starts a redis-server on a free loopback port and stops it when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redis-server is not on PATH (apt-get install -y redis-server; .ci/run installs it): %v", err)
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir(), port: freePort(t)}
	t.Cleanup(s.kill)
	s.Restart()
	return s
}

// freePort is a loopback port nothing listens on at the moment: the kernel's pick for a
// listener that is closed at once. Another process could take it before redis-server does;
// on a test machine that is rare, and a start that fails says so.
func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("find a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// Addr is the server's host:port, the same after every restart.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// Restart starts the server again on its port after Stop (or for the first time), empty: it
// keeps nothing on disk. It returns once the server answers PING.
func (s *Server) Restart() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		s.t.Fatalf("redistest: the server on %s is already running", s.Addr())
	}
	s.starts++
	logPath := filepath.Join(s.dir, fmt.Sprintf("redis-%d.log", s.starts))
	log, err := os.Create(logPath)
	if err != nil {
		s.t.Fatalf("redistest: %v", err)
	}
	cmd := exec.Command(s.bin,
		"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.dir,
		"--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		s.t.Fatalf("redistest: start redis-server: %v", err)
	}
	s.cmd, s.log = cmd, log
	deadline := time.Now().Add(startTimeout)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for ; ; <-tick.C {
		if err := ping(s.Addr()); err == nil {
			return
		} else if time.Now().After(deadline) {
			out, _ := os.ReadFile(logPath)
			s.killLocked()
			s.t.Fatalf("redistest: redis-server on %s did not answer PING within %s: %v\n%s", s.Addr(), startTimeout, err, out)
		}
	}
}

// Stop kills the server at once (SIGKILL), as a crash would: its connections reset, new ones
// are refused, and what it held is gone.
func (s *Server) Stop() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		s.t.Fatalf("redistest: the server on %s is not running", s.Addr())
	}
	s.killLocked()
}

// Pause stops the server's process (SIGSTOP): the kernel still accepts connections and reads
// for it, and nothing answers, until Resume.
func (s *Server) Pause() { s.signal(syscall.SIGSTOP) }

// Resume lets a paused server go on (SIGCONT).
func (s *Server) Resume() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		s.t.Fatalf("redistest: the server on %s is not running", s.Addr())
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("redistest: signal %s: %v", sig, err)
	}
}

// Do sends one command (its words, as redis-cli takes them) on a connection of its own and
// returns the reply's first line: for a test to look at the server's state as an operator
// would (DBSIZE, ZCARD ...).
func (s *Server) Do(args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", s.Addr(), time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(b.String())); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	if strings.HasPrefix(line, "-") {
		return "", fmt.Errorf("redis: %s", line[1:])
	}
	return line, nil
}

func (s *Server) kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
}

// killLocked kills a running server (a paused one too: SIGKILL needs no SIGCONT) and waits
// for its process.
func (s *Server) killLocked() {
	if s.cmd == nil {
		return
	}
	s.cmd.Process.Kill()
	s.cmd.Wait()
	s.log.Close()
	s.cmd, s.log = nil, nil
}

// ping is one PING on a fresh connection.
func ping(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if strings.TrimSpace(line) != "+PONG" {
		return fmt.Errorf("PING answered %q", line)
	}
	return nil
}
