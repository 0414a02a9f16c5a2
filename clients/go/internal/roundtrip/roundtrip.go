// Package roundtrip counts the round trips a pgx pool makes: one
// ReadyForQuery message per round trip, read off its connections. The
// benchmark and the tests share it.
package roundtrip

import (
	"context"
	"encoding/binary"
	"net"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Counter counts the ReadyForQuery messages of the connections it dials.
type Counter struct{ n atomic.Int64 }

// Count is the number of round trips so far.
func (c *Counter) Count() int64 { return c.n.Load() }

// Dial makes cfg's connections plain text (so that the messages can be
// read; on 127.0.0.1 anyway) and counted by c.
func (c *Counter) Dial(cfg *pgxpool.Config) {
	cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
	dialer := &net.Dialer{KeepAlive: 5 * time.Minute}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: conn, counter: c}, nil
	}
}

// countingConn counts the ReadyForQuery ('Z') messages the server sends. It
// follows the message framing (a type byte, a 4-byte length that counts
// itself, the rest) across reads; the connection is plain text from its
// first byte, since no SSLRequest is sent.
type countingConn struct {
	net.Conn
	counter *Counter
	header  [5]byte
	have    int   // bytes of header read so far
	skip    int64 // bytes of the current message's body still to pass
}

// Read reads from the server and counts the messages that ended in it.
func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	for b := p[:n]; len(b) > 0; {
		if c.skip > 0 {
			step := min(int64(len(b)), c.skip)
			c.skip -= step
			b = b[step:]
			continue
		}
		m := copy(c.header[c.have:], b)
		c.have += m
		b = b[m:]
		if c.have == len(c.header) {
			if c.header[0] == 'Z' {
				c.counter.n.Add(1)
			}
			c.skip = int64(binary.BigEndian.Uint32(c.header[1:])) - 4
			c.have = 0
		}
	}
	return n, err
}
