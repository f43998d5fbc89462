// interop: etcd's own clientv3/concurrency Mutex and Election, as a Go service uses them, driven
// over stdin and stdout by tests/test_interop.py (built by scripts/etcd-build --interop):
//
//	interop lock -endpoints 127.0.0.1:2379 -key /app/locks/N
//	    prints "acquired <key>" once it holds the lock; a line on stdin (or its end) releases it: "released"
//	interop elect -endpoints ... -key /app/elections/N -value V
//	    prints "leader" once it leads with proposal V; a line on stdin resigns: "resigned"
//	interop leader -endpoints ... -key /app/elections/N
//	    prints the leader's proposal value, or "none"
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

func fail(what string, err error) {
	fmt.Fprintf(os.Stderr, "interop: %s: %v\n", what, err)
	os.Exit(1)
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: interop lock|elect|leader -endpoints H:P -key K [-value V] [-ttl S]")
		os.Exit(2)
	}
	mode := os.Args[1]
	flags := flag.NewFlagSet(mode, flag.ExitOnError)
	endpoints := flags.String("endpoints", "127.0.0.1:2379", "comma-separated client endpoints")
	key := flags.String("key", "", "the lock's or election's prefix")
	value := flags.String("value", "go", "the election proposal")
	ttl := flags.Int("ttl", 10, "the session's lease TTL in seconds")
	_ = flags.Parse(os.Args[2:])

	cli, err := clientv3.New(clientv3.Config{Endpoints: strings.Split(*endpoints, ","), DialTimeout: 10 * time.Second})
	if err != nil {
		fail("connect", err)
	}
	defer cli.Close()
	session, err := concurrency.NewSession(cli, concurrency.WithTTL(*ttl))
	if err != nil {
		fail("session", err)
	}
	defer session.Close()
	ctx := context.Background()
	stdin := bufio.NewScanner(os.Stdin)

	switch mode {
	case "lock":
		mutex := concurrency.NewMutex(session, *key)
		if err := mutex.Lock(ctx); err != nil {
			fail("lock", err)
		}
		fmt.Printf("acquired %s\n", mutex.Key())
		stdin.Scan()
		if err := mutex.Unlock(ctx); err != nil {
			fail("unlock", err)
		}
		fmt.Println("released")
	case "elect":
		election := concurrency.NewElection(session, *key)
		if err := election.Campaign(ctx, *value); err != nil {
			fail("campaign", err)
		}
		fmt.Println("leader")
		stdin.Scan()
		if err := election.Resign(ctx); err != nil {
			fail("resign", err)
		}
		fmt.Println("resigned")
	case "leader":
		election := concurrency.NewElection(session, *key)
		leader, err := election.Leader(ctx)
		if errors.Is(err, concurrency.ErrElectionNoLeader) {
			fmt.Println("none")
		} else if err != nil {
			fail("leader", err)
		} else {
			fmt.Println(string(leader.Kvs[0].Value))
		}
	default:
		fail("mode", fmt.Errorf("unknown mode %q", mode))
	}
}
