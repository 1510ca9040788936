// Command quantity reads Kubernetes quantities with k8s.io/apimachinery's own parser, for
// the agent's differential test (tests/claims/test_quantity.py). Each input line is one JSON
// value (a string or a number) as a config would carry it; each output line is a JSON
// object: ok, and for a quantity its exact value ("exact", a decimal) and Value().
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/api/resource"
)

type answer struct {
	OK    bool   `json:"ok"`
	Exact string `json:"exact,omitempty"`
	Value int64  `json:"value,omitempty"`
	Error string `json:"error,omitempty"`
}

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<20)
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	encoder := json.NewEncoder(out)
	for in.Scan() {
		var q resource.Quantity
		var a answer
		if err := json.Unmarshal(in.Bytes(), &q); err != nil {
			a.Error = err.Error()
		} else {
			a.OK, a.Exact, a.Value = true, q.AsDec().String(), q.Value()
		}
		if err := encoder.Encode(a); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
