// Command noprovider is a program that imports conn and no provider: its
// Listen and Dial must say which import is missing (TestNoProviderImported).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/rdmagrpc/rdmagrpc/conn"
)

func main() {
	_, lerr := conn.Listen(context.Background(), "127.0.0.1:0")
	_, derr := conn.Dial(context.Background(), "127.0.0.1:1")
	fmt.Println(lerr)
	fmt.Println(derr)
	if !errors.Is(lerr, conn.ErrNoProvider) || !errors.Is(derr, conn.ErrNoProvider) {
		os.Exit(1)
	}
}
