package e2e

import (
	"bufio"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// optionalPrograms are programs a test runs only when they are there, saying so when they are
// not: Go itself (the machine has it), and nginx, a benchmark's contender.
var optionalPrograms = []string{"go", "nginx"}

// programsTheTestsRun are the programs the repository's Go code looks up or runs by name.
func programsTheTestsRun(t *testing.T) []string {
	t.Helper()
	re := regexp.MustCompile(`exec\.(?:LookPath|Command)\("([^"]+)"`)
	var names []string
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range re.FindAllSubmatch(b, -1) {
			if n := string(m[1]); !slices.Contains(names, n) && !slices.Contains(optionalPrograms, n) {
				names = append(names, n)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(names)
	return names
}

func TestTheReadmesTestCommandInstallsEveryProgramTheTestsRun(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	// The README's first block of commands: the proxy, then the tests.
	_, block, _ := strings.Cut(string(readme), "```sh\n")
	block, _, _ = strings.Cut(block, "```")
	var cmds []string
	sc := bufio.NewScanner(strings.NewReader(block))
	for sc.Scan() {
		if c, _, _ := strings.Cut(sc.Text(), "#"); strings.TrimSpace(c) != "" {
			cmds = append(cmds, strings.TrimSpace(c))
		}
	}
	if len(cmds) != 2 || cmds[0] != "go run ./cmd/proxy" || cmds[1] != "./test.sh" {
		t.Fatalf("the README starts with %q, want the proxy's command and ./test.sh", cmds)
	}
	ci, err := os.ReadFile("../.ci/run")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^(bash )?(\./)?test\.sh -race$`).Match(ci) {
		t.Errorf(".ci/run does not run the README's test command with -race:\n%s", ci)
	}

	// On a machine with none of them, test.sh would install every program the tests run.
	bin := t.TempDir()
	for _, tool := range []string{"bash", "dirname", "env", "id"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(filepath.Join(bin, "bash"), "../test.sh", "--missing")
	cmd.Env = []string{"PATH=" + bin}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("test.sh --missing: %v\n%s", err, out)
	}
	installs := strings.Fields(string(out))
	programs := programsTheTestsRun(t)
	if len(programs) < 3 {
		t.Fatalf("found %q among the programs the tests run, want curl, redis-server and chromium at least", programs)
	}
	for _, p := range programs {
		if !slices.Contains(installs, p) {
			t.Errorf("the tests run %s, which test.sh does not install on a machine without it (it would install %q)", p, installs)
		}
	}
}
