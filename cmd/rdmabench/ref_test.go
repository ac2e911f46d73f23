package main

import (
	"math"
	"strings"
	"testing"
)

// Outputs as perftest 6.06 and rdma-core 44's rstream print them.
const (
	perftestBW = ` local address: LID 0000 QPN 0x0013 PSN 0x3ee4d
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 32768      1000             48.08              47.49  		   0.001520
---------------------------------------------------------------------------------------
`
	perftestLat = `---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 64      1000          13.39          288.03       15.09    	       18.27       	16.02  		103.50  		288.03 
---------------------------------------------------------------------------------------
`
	rstreamOut = `name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer
custom    32k     1k      1       62m         1.80s      0.29     899.25
`
)

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

func TestParseReferenceTools(t *testing.T) {
	bw, err := parsePerftestBW(perftestBW)
	if err != nil || !near(bw, 47.49*(1<<20)) {
		t.Errorf("parsePerftestBW = %v, %v", bw, err)
	}
	p50, mean, err := parsePerftestLat(perftestLat)
	if err != nil || !near(p50, 15.09e-6) || !near(mean, 18.27e-6) {
		t.Errorf("parsePerftestLat = %v, %v, %v", p50, mean, err)
	}
	secs, per, err := parseRstream(rstreamOut)
	if err != nil || !near(secs, 1.80) || !near(per, 899.25e-6) {
		t.Errorf("parseRstream = %v, %v, %v", secs, per, err)
	}
	p50, mean, err = parseRefPingPong("provider=verbs p50_us=944.000 mean_us=1347.200\n")
	if err != nil || !near(p50, 944e-6) || !near(mean, 1347.2e-6) {
		t.Errorf("parseRefPingPong = %v, %v, %v", p50, mean, err)
	}
	if got := refMBps(12345); got != "0.012 MB/s" {
		t.Errorf("refMBps(12345) = %s", got)
	}
	if got := refMBps(36.94e6); got != "36.9 MB/s" {
		t.Errorf("refMBps(36.94e6) = %s", got)
	}
	if _, err := parsePerftestBW("Unable to perform rdma_client function\n"); err == nil {
		t.Error("parsePerftestBW of a failed run: no error")
	}
}

func TestRefCommands(t *testing.T) {
	cfg := refConfig{dev: "rxe0", gid: 1, server: "10.99.0.1", provider: "verbs", bytes: 128 << 20, maxMsgs: 100000, latIters: 20000}
	for _, c := range []struct {
		s        refStep
		srv, cli string
	}{
		{refStep{tool: refWriteBW, size: 32 << 10},
			"ib_write_bw -d rxe0 -x 1 -R -F -s 32768 -n 4096 -p 20001",
			"ib_write_bw -d rxe0 -x 1 -R -F -s 32768 -n 4096 -p 20001 10.99.0.1"},
		{refStep{tool: refRstream, size: 64, lat: true},
			"rstream -p 20001 -S 64 -C 1 -I 20000",
			"rstream -s 10.99.0.1 -p 20001 -S 64 -C 1 -I 20000"},
		{refStep{tool: refRings, size: 1 << 20},
			"rdmabench refchild -serve 10.99.0.1:20001 -size 1048576 -count 128 -provider verbs -rings",
			"rdmabench refchild -dial 10.99.0.1:20001 -op write -size 1048576 -count 128 -provider verbs -rings"},
		{refStep{tool: refWriteBW, size: 64},
			"ib_write_bw -d rxe0 -x 1 -R -F -s 64 -n 100000 -p 20001",
			"ib_write_bw -d rxe0 -x 1 -R -F -s 64 -n 100000 -p 20001 10.99.0.1"},
		// Over 8 connections: perftest's -n is per QP, rdmagrpc's count
		// is shared among its connections.
		{refStep{tool: refWriteBW, size: 32 << 10, conns: 8},
			"ib_write_bw -d rxe0 -x 1 -R -F -s 32768 -n 512 -p 20001 -q 8",
			"ib_write_bw -d rxe0 -x 1 -R -F -s 32768 -n 512 -p 20001 -q 8 10.99.0.1"},
		{refStep{tool: refRDMA, size: 32 << 10, conns: 8},
			"rdmabench refchild -serve 10.99.0.1:20001 -size 32768 -count 4096 -provider verbs -conns 8",
			"rdmabench refchild -dial 10.99.0.1:20001 -op write -size 32768 -count 4096 -provider verbs -conns 8"},
	} {
		srv, cli := cfg.commands(c.s, 20001)
		if got := strings.Join(srv, " "); got != c.srv {
			t.Errorf("%v server: %s, want %s", c.s, got, c.srv)
		}
		if got := strings.Join(cli, " "); got != c.cli {
			t.Errorf("%v client: %s, want %s", c.s, got, c.cli)
		}
	}
}
