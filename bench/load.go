package bench

import (
	"fmt"
	"os/exec"
)

// startLoad starts n CPU-bound processes, each a shell spinning in a loop
// as a busy neighbour would, and returns what stops them.
func startLoad(n int) (stop func(), err error) {
	var cmds []*exec.Cmd
	stop = func() {
		for _, c := range cmds {
			c.Process.Kill()
			c.Wait()
		}
	}
	for range n {
		c := exec.Command("/bin/sh", "-c", "while :; do :; done")
		if err := c.Start(); err != nil {
			stop()
			return nil, fmt.Errorf("bench: start a CPU-bound process: %w", err)
		}
		cmds = append(cmds, c)
	}
	return stop, nil
}
