package bench

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// nginxProc is an nginx in front of the decoder, the reference the proxy is measured
// against: a reverse proxy in C with keep-alive upstream connections and no buffering, as
// one puts in front of an SSE engine. The harness runs it when the nginx binary is installed
// (apt-get install nginx-light), and says so in the report when it is not; CI does not
// install it.
type nginxProc struct {
	cmd *exec.Cmd
	url string
}

// nginxBinary is the nginx to run: PDPROXY_BENCH_NGINX, else nginx on PATH or in /usr/sbin.
func nginxBinary() string {
	if p := os.Getenv("PDPROXY_BENCH_NGINX"); p != "" {
		return p
	}
	if p, err := exec.LookPath("nginx"); err == nil {
		return p
	}
	if _, err := os.Stat("/usr/sbin/nginx"); err == nil {
		return "/usr/sbin/nginx"
	}
	return ""
}

// nginxConf proxies to upstream with what an SSE engine needs: HTTP/1.1 keep-alive upstream
// connections, no response or request buffering. worker_processes auto: one per CPU, as
// the proxy's GOMAXPROCS is.
const nginxConf = `daemon off;
master_process on;
worker_processes auto;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 4096; }
http {
	access_log off;
	client_body_temp_path %[1]s/body;
	proxy_temp_path %[1]s/proxy;
	fastcgi_temp_path %[1]s/fastcgi;
	uwsgi_temp_path %[1]s/uwsgi;
	scgi_temp_path %[1]s/scgi;
	upstream engine {
		server %[2]s;
		keepalive 256;
	}
	server {
		listen %[3]s;
		location / {
			proxy_pass http://engine;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
			proxy_buffering off;
			proxy_request_buffering off;
		}
	}
}
`

// startNginx runs nginx in front of upstream (host:port), or returns nil, with the reason,
// when there is no nginx.
func startNginx(t testing.TB, upstream string) (*nginxProc, string) {
	t.Helper()
	bin := nginxBinary()
	if bin == "" {
		return nil, "nginx is not installed (apt-get install nginx-light): its figures are skipped"
	}
	dir := t.TempDir()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	conf := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(nginxConf, dir, upstream, addr)), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-e", filepath.Join(dir, "error.log"), "-p", dir, "-c", conf)
	if os.Getenv("PDPROXY_BENCH_VERBOSE") != "" {
		cmd.Stderr = os.Stderr
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Sprintf("nginx (%s) did not start: %v; its figures are skipped", bin, err)
	}
	n := &nginxProc{cmd: cmd, url: "http://" + addr}
	t.Cleanup(n.stop)
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return n, ""
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			n.stop()
			return nil, fmt.Sprintf("nginx did not listen on %s within 10 s (%.300s); its figures are skipped", addr, log)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (n *nginxProc) stop() {
	if n.cmd.Process == nil || n.cmd.ProcessState != nil {
		return
	}
	n.cmd.Process.Signal(os.Interrupt) // SIGINT: fast shutdown, workers included
	done := make(chan struct{})
	go func() { n.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		n.cmd.Process.Kill()
		<-done
	}
}

// cpuSeconds is the user and system time of nginx's master and its workers so far, from
// /proc (Linux only; elsewhere an error, and no CPU figure).
func (n *nginxProc) cpuSeconds() (float64, error) {
	master := n.cmd.Process.Pid
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	var ticks float64
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		ppid, t, err := procStat(pid)
		if err != nil || (pid != master && ppid != master) {
			continue
		}
		ticks += t
	}
	return ticks / 100, nil // USER_HZ is 100 on Linux
}

// procStat reads a process's parent and its utime+stime in clock ticks from /proc/PID/stat.
func procStat(pid int) (ppid int, ticks float64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	line, err := bufio.NewReader(f).ReadString('\n')
	if err != nil && line == "" {
		return 0, 0, err
	}
	// The command name is in parentheses and may hold spaces: fields start after the last ')'.
	i := strings.LastIndexByte(line, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	f2 := strings.Fields(line[i+1:])
	if len(f2) < 13 {
		return 0, 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	ppid, _ = strconv.Atoi(f2[1])
	ut, _ := strconv.ParseFloat(f2[11], 64)
	st, _ := strconv.ParseFloat(f2[12], 64)
	return ppid, ut + st, nil
}
