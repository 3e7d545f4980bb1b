package tracker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// EtcdConfig configures an EtcdStore.
type EtcdConfig struct {
	Endpoints []string // host:port of the etcd members
	// Prefix is the root of the mesh's keys (default "/meshgpu/"); trackers
	// of one mesh share it, other meshes use others.
	Prefix string
	// TTL is the lease of a node record: a node that stops heartbeating
	// disappears from etcd this long (rounded up to seconds) after its
	// last heartbeat. Use the heartbeat timeout (default 15s).
	TTL time.Duration
	// Self is this tracker, published under trackers/ while it runs.
	Self        TrackerInfo
	DialTimeout time.Duration // default 5s
	// Wait bounds how long a write waits for its own change to come back
	// through the watch (default 5s).
	Wait   time.Duration
	Logger *slog.Logger
}

// EtcdStore is a Store in etcd shared by all trackers of a mesh. Every
// key lives under Prefix (docs/tracker.md, "etcd layout"). A watch keeps an
// in-memory copy current, so reads (route requests) never reach etcd;
// writes are etcd transactions that compare revisions, and return once
// the watch has brought the change back (a tracker reads its own writes).
type EtcdStore struct {
	cli    *clientv3.Client
	cfg    EtcdConfig
	log    *slog.Logger
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu   sync.RWMutex
	cond *sync.Cond // signalled (under mu) when rev grows
	rev  int64      // the etcd revision the copy reflects
	c    etcdView
}

// etcdView is the decoded copy of the mesh's keys.
type etcdView struct {
	nodes    map[string]cachedNode
	sorted   []NodeRecord // nodes by peer id; nil after a change
	bans     map[string]time.Time
	banStart map[string]time.Time // when each ban began; absent for bans written without it
	status   map[string]NodeStatus
	reserved map[string]Reservation
	assigns  map[string]int64 // model: mod revision of assign/<model>
	trackers map[string]TrackerInfo
}

type cachedNode struct {
	rec   NodeRecord
	lease clientv3.LeaseID
}

// storedNode is a node record as etcd holds it: the fields the API does
// not show are kept too, so any tracker can carry on where another left.
type storedNode struct {
	NodeRecord
	LastTimestamp  int64     `json:"last_timestamp"`
	MoveAt         time.Time `json:"move_at"`
	RelayDownSince time.Time `json:"relay_down_since,omitzero"`
}

// Key prefixes under EtcdConfig.Prefix.
const (
	etcdNodes    = "nodes/"        // nodes/<peer id>: storedNode JSON, under the node's lease
	etcdModels   = "models/"       // models/<model>: a layer count older trackers wrote (ignored: the registry elects one per variant)
	etcdBans     = "bans/"         // bans/<peer id>: "end,start" (unix ms; older trackers wrote the end only), under a lease of the ban's length
	etcdStatus   = "status/"       // status/<peer id>: NodeStatus JSON, no lease
	etcdReserved = "reservations/" // reservations/<peer id>: Reservation JSON, under a lease of 2 heartbeat timeouts
	etcdAssign   = "assign/"       // assign/<model>: empty; its mod revision orders the model's assignments
	etcdTrackers = "trackers/"     // trackers/<peer id>: TrackerInfo JSON, under the tracker's own kept-alive lease
)

// OpenEtcd connects, loads the mesh's keys, starts the watch and publishes
// cfg.Self. Close stops it.
func OpenEtcd(ctx context.Context, cfg EtcdConfig) (*EtcdStore, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("etcd store: no endpoints")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "/meshgpu/"
	}
	if !strings.HasSuffix(cfg.Prefix, "/") {
		cfg.Prefix += "/"
	}
	if cfg.TTL <= 0 {
		cfg.TTL = 15 * time.Second
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	if cfg.Wait <= 0 {
		cfg.Wait = 5 * time.Second
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, DialTimeout: cfg.DialTimeout, Context: context.Background(),
		Logger: zap.NewNop()})
	if err != nil {
		return nil, fmt.Errorf("etcd %v: %w", cfg.Endpoints, err)
	}
	s := &EtcdStore{cli: cli, cfg: cfg, log: log}
	s.cond = sync.NewCond(&s.mu)
	lctx, cancel := context.WithTimeout(ctx, cfg.DialTimeout)
	defer cancel()
	if err := s.load(lctx); err != nil {
		cli.Close()
		return nil, fmt.Errorf("etcd %v: %w", cfg.Endpoints, err)
	}
	wctx, wcancel := context.WithCancel(context.Background())
	s.cancel = wcancel
	s.wg.Add(1)
	go s.watch(wctx)
	if cfg.Self.PeerID != "" {
		s.wg.Add(1)
		go s.publish(wctx)
	}
	return s, nil
}

// Close stops the watch, withdraws this tracker and disconnects.
func (s *EtcdStore) Close() error {
	s.cancel()
	s.mu.Lock()
	s.cond.Broadcast()
	s.mu.Unlock()
	s.wg.Wait()
	return s.cli.Close()
}

// load replaces the copy with a snapshot of every key.
func (s *EtcdStore) load(ctx context.Context) error {
	resp, err := s.cli.Get(ctx, s.cfg.Prefix, clientv3.WithPrefix())
	if err != nil {
		return err
	}
	v := newEtcdView()
	for _, kv := range resp.Kvs {
		v.apply(s.log, strings.TrimPrefix(string(kv.Key), s.cfg.Prefix), kv.Value, kv.ModRevision, clientv3.LeaseID(kv.Lease), false)
	}
	s.mu.Lock()
	if resp.Header.Revision >= s.rev { // else the watch has gone past it
		s.c, s.rev = v, resp.Header.Revision
		s.cond.Broadcast()
	}
	s.mu.Unlock()
	return nil
}

func newEtcdView() etcdView {
	return etcdView{nodes: map[string]cachedNode{}, bans: map[string]time.Time{}, banStart: map[string]time.Time{},
		status: map[string]NodeStatus{}, reserved: map[string]Reservation{}, assigns: map[string]int64{}, trackers: map[string]TrackerInfo{}}
}

// watch applies changes from etcd until ctx ends; after a broken or
// compacted watch it loads a fresh snapshot and watches from there.
func (s *EtcdStore) watch(ctx context.Context) {
	defer s.wg.Done()
	for ctx.Err() == nil {
		s.mu.RLock()
		from := s.rev + 1
		s.mu.RUnlock()
		wch := s.cli.Watch(ctx, s.cfg.Prefix, clientv3.WithPrefix(), clientv3.WithRev(from))
		for resp := range wch {
			if err := resp.Err(); err != nil {
				s.log.Warn("etcd watch failed; reloading", "err", err)
				break
			}
			s.mu.Lock()
			for _, ev := range resp.Events {
				if ev.Kv.ModRevision <= s.rev {
					continue // in the snapshot already
				}
				s.c.apply(s.log, strings.TrimPrefix(string(ev.Kv.Key), s.cfg.Prefix), ev.Kv.Value, ev.Kv.ModRevision,
					clientv3.LeaseID(ev.Kv.Lease), ev.Type == clientv3.EventTypeDelete)
			}
			rev := s.rev
			if n := len(resp.Events); n > 0 {
				rev = resp.Events[n-1].Kv.ModRevision
			}
			if rev > s.rev {
				s.rev = rev
				s.cond.Broadcast()
			}
			s.mu.Unlock()
		}
		if ctx.Err() != nil {
			return
		}
		t := time.NewTimer(200 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		lctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
		if err := s.load(lctx); err != nil && ctx.Err() == nil {
			s.log.Warn("etcd reload failed", "err", err)
		}
		cancel()
	}
}

// apply records one key's change (key is relative to the prefix).
func (v *etcdView) apply(log *slog.Logger, key string, value []byte, rev int64, lease clientv3.LeaseID, deleted bool) {
	kind, id, ok := strings.Cut(key, "/")
	if !ok {
		return
	}
	kind += "/"
	bad := func(err error) {
		log.Warn("etcd store: ignoring an unreadable key", "key", key, "err", err)
	}
	switch kind {
	case etcdNodes:
		v.sorted = nil
		if deleted {
			delete(v.nodes, id)
			return
		}
		var sn storedNode
		if err := json.Unmarshal(value, &sn); err != nil {
			bad(err)
			return
		}
		rec := sn.NodeRecord
		rec.LastTimestamp, rec.MoveAt, rec.Revision, rec.RelayDownSince = sn.LastTimestamp, sn.MoveAt, rev, sn.RelayDownSince
		v.nodes[id] = cachedNode{rec: rec, lease: lease}
	case etcdModels:
	case etcdBans:
		end, start, hasStart := strings.Cut(string(value), ",")
		ms, err := strconv.ParseInt(end, 10, 64)
		var sms int64
		if err == nil && hasStart {
			sms, err = strconv.ParseInt(start, 10, 64)
		}
		switch {
		case deleted:
			delete(v.bans, id)
			delete(v.banStart, id)
		case err != nil:
			bad(err)
		default:
			v.bans[id] = time.UnixMilli(ms)
			delete(v.banStart, id)
			if hasStart {
				v.banStart[id] = time.UnixMilli(sms)
			}
		}
	case etcdStatus:
		var st NodeStatus
		switch {
		case deleted:
			delete(v.status, id)
		case json.Unmarshal(value, &st) != nil:
			bad(errors.New("not a status"))
		default:
			v.status[id] = st
		}
	case etcdReserved:
		var r Reservation
		switch {
		case deleted:
			delete(v.reserved, id)
		case json.Unmarshal(value, &r) != nil:
			bad(errors.New("not a reservation"))
		default:
			v.reserved[id] = r
		}
	case etcdAssign:
		if deleted {
			delete(v.assigns, id)
		} else {
			v.assigns[id] = rev
		}
	case etcdTrackers:
		var t TrackerInfo
		switch {
		case deleted:
			delete(v.trackers, id)
		case json.Unmarshal(value, &t) != nil:
			bad(errors.New("not a tracker"))
		default:
			v.trackers[id] = t
		}
	}
}

// caughtUp waits until the copy reflects revision rev: a write's own
// change comes back through the watch. After a failed comparison the
// change that beat us may be outside the prefix's events or still on its
// way, so a fresh snapshot is read instead (conflicts are rare; etcd
// 3.4's progress notices may overtake pending events, so they are not
// used to advance the copy).
func (s *EtcdStore) caughtUp(ctx context.Context, rev int64, failed bool) error {
	if failed {
		return s.load(ctx)
	}
	deadline := time.Now().Add(s.cfg.Wait)
	wake := func() {
		s.mu.Lock()
		s.cond.Broadcast()
		s.mu.Unlock()
	}
	stop := context.AfterFunc(ctx, wake)
	defer stop()
	timer := time.AfterFunc(s.cfg.Wait, wake)
	defer timer.Stop()
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.rev < rev {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("etcd store: the watch is at revision %d, not yet at %d after %v", s.rev, rev, s.cfg.Wait)
		}
		s.cond.Wait()
	}
	return nil
}

// txn runs an etcd transaction and waits for its outcome in the copy; a
// failed comparison is ErrConflict.
func (s *EtcdStore) txn(ctx context.Context, cmps []clientv3.Cmp, ops ...clientv3.Op) error {
	resp, err := s.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		// The lease expired under us: the record went with it.
		if gerr := s.load(ctx); gerr != nil {
			return gerr
		}
		return ErrConflict
	}
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	if err := s.caughtUp(ctx, resp.Header.Revision, !resp.Succeeded); err != nil {
		return err
	}
	if !resp.Succeeded {
		return ErrConflict
	}
	return nil
}

func (s *EtcdStore) grant(ctx context.Context, ttl time.Duration) (clientv3.LeaseID, error) {
	secs := int64(math.Ceil(ttl.Seconds()))
	if secs < 1 {
		secs = 1
	}
	l, err := s.cli.Grant(ctx, secs)
	if err != nil {
		return 0, fmt.Errorf("etcd lease: %w", err)
	}
	return l.ID, nil
}

func (s *EtcdStore) List(ctx context.Context) ([]NodeRecord, error) {
	var out []NodeRecord
	err := s.View(ctx, func(recs []NodeRecord) error {
		// Callers may change the slice they get; the copy's stays as it is.
		out = append([]NodeRecord(nil), recs...)
		return nil
	})
	return out, err
}

// View hands out the sorted list, which is replaced, never changed, when
// the copy changes.
func (s *EtcdStore) View(_ context.Context, fn func([]NodeRecord) error) error {
	s.mu.RLock()
	sorted := s.c.sorted
	s.mu.RUnlock()
	if sorted == nil {
		s.mu.Lock()
		if s.c.sorted == nil {
			m := make(map[string]NodeRecord, len(s.c.nodes))
			for id, n := range s.c.nodes {
				m[id] = n.rec
			}
			s.c.sorted = sortedRecords(m)
		}
		sorted = s.c.sorted
		s.mu.Unlock()
	}
	return fn(sorted)
}

func (s *EtcdStore) Get(_ context.Context, peerID string) (NodeRecord, bool, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	n, ok := s.c.nodes[peerID]
	return n.rec, ok, nil
}

// Put writes the record under the node's lease (a new one for a new
// record) and refreshes the lease: a heartbeat keeps the record alive.
func (s *EtcdStore) Put(ctx context.Context, rec NodeRecord) error {
	key := s.cfg.Prefix + etcdNodes + rec.PeerID
	s.mu.RLock()
	cur, exists := s.c.nodes[rec.PeerID]
	s.mu.RUnlock()
	if cur.rec.Revision != rec.Revision {
		return ErrConflict
	}
	lease, fresh := cur.lease, false
	if !exists || lease == 0 {
		var err error
		if lease, err = s.grant(ctx, s.cfg.TTL); err != nil {
			return err
		}
		fresh = true
	} else if _, err := s.cli.KeepAliveOnce(ctx, lease); err != nil {
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return s.lost(ctx, rec.PeerID)
		}
		return fmt.Errorf("etcd lease: %w", err)
	}
	sn, err := json.Marshal(storedNode{NodeRecord: rec, LastTimestamp: rec.LastTimestamp, MoveAt: rec.MoveAt, RelayDownSince: rec.RelayDownSince})
	if err != nil {
		return err
	}
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", rec.Revision)}
	err = s.txn(ctx, cmps, clientv3.OpPut(key, string(sn), clientv3.WithLease(lease)))
	if err != nil && fresh {
		s.revoke(lease)
	}
	return err
}

// lost handles a node whose lease expired in etcd before this tracker's
// copy dropped it: a fresh snapshot has it gone, and the caller reads
// again (the node then has to register anew).
func (s *EtcdStore) lost(ctx context.Context, _ string) error {
	if err := s.load(ctx); err != nil {
		return err
	}
	return ErrConflict
}

func (s *EtcdStore) revoke(lease clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.DialTimeout)
	defer cancel()
	if _, err := s.cli.Revoke(ctx, lease); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		s.log.Warn("etcd lease revoke failed", "err", err)
	}
}

// Delete removes an expired record and its lease (and so the model key
// when that node wrote it last; the next heartbeat of the model writes it
// again).
func (s *EtcdStore) Delete(ctx context.Context, rec NodeRecord) error {
	key := s.cfg.Prefix + etcdNodes + rec.PeerID
	s.mu.RLock()
	cur, ok := s.c.nodes[rec.PeerID]
	s.mu.RUnlock()
	if !ok || cur.rec.Revision != rec.Revision {
		return nil
	}
	err := s.txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", rec.Revision)}, clientv3.OpDelete(key))
	if errors.Is(err, ErrConflict) {
		return nil // refreshed or removed meanwhile
	}
	if err == nil && cur.lease != 0 {
		s.revoke(cur.lease)
	}
	return err
}

func (s *EtcdStore) Ban(ctx context.Context, peerID string, until time.Time, ttl time.Duration) error {
	lease, err := s.grant(ctx, ttl)
	if err != nil {
		return err
	}
	v := strconv.FormatInt(until.UnixMilli(), 10) + "," + strconv.FormatInt(until.Add(-ttl).UnixMilli(), 10)
	return s.txn(ctx, nil, clientv3.OpPut(s.cfg.Prefix+etcdBans+peerID, v, clientv3.WithLease(lease)))
}

func (s *EtcdStore) Unban(ctx context.Context, peerID string) error {
	return s.txn(ctx, nil, clientv3.OpDelete(s.cfg.Prefix+etcdBans+peerID))
}

func (s *EtcdStore) UnbanSince(ctx context.Context, peerID string, since time.Time) error {
	s.mu.RLock()
	start, ok := s.c.banStart[peerID]
	until := s.c.bans[peerID]
	s.mu.RUnlock()
	if !ok || start.Before(since) {
		return nil
	}
	key := s.cfg.Prefix + etcdBans + peerID
	v := strconv.FormatInt(until.UnixMilli(), 10) + "," + strconv.FormatInt(start.UnixMilli(), 10)
	// Only the ban seen: a newer one written meanwhile stays.
	err := s.txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.Value(key), "=", v)}, clientv3.OpDelete(key))
	if errors.Is(err, ErrConflict) {
		return nil
	}
	return err
}

func (s *EtcdStore) Bans(_ context.Context, now time.Time) (map[string]time.Time, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make(map[string]time.Time, len(s.c.bans))
	for id, until := range s.c.bans {
		if until.After(now) {
			out[id] = until
		}
	}
	return out, nil
}

func (s *EtcdStore) SetStatus(ctx context.Context, st NodeStatus) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return s.txn(ctx, nil, clientv3.OpPut(s.cfg.Prefix+etcdStatus+st.PeerID, string(b)))
}

func (s *EtcdStore) Statuses(context.Context) (map[string]NodeStatus, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make(map[string]NodeStatus, len(s.c.status))
	for id, st := range s.c.status {
		out[id] = st
	}
	return out, nil
}

func (s *EtcdStore) Reservations(_ context.Context, model string, now time.Time) ([]Reservation, int64, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []Reservation
	for _, r := range s.c.reserved {
		if r.Model == model && !now.After(r.Expiry) {
			out = append(out, r)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PeerID < out[j].PeerID })
	return out, s.c.assigns[model], nil
}

// Reserve writes the reservation and bumps assign/<model> only while that
// key is at token: two trackers assigning for one model at once do not
// both hand out the same range.
func (s *EtcdStore) Reserve(ctx context.Context, r Reservation, token int64, ttl time.Duration) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	lease, err := s.grant(ctx, ttl)
	if err != nil {
		return err
	}
	akey := s.cfg.Prefix + etcdAssign + r.Model
	err = s.txn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(akey), "=", token)},
		clientv3.OpPut(akey, "", clientv3.WithLease(lease)),
		clientv3.OpPut(s.cfg.Prefix+etcdReserved+r.PeerID, string(b), clientv3.WithLease(lease)))
	if err != nil {
		s.revoke(lease)
	}
	return err
}

func (s *EtcdStore) Unreserve(ctx context.Context, peerID string) error {
	s.mu.RLock()
	_, ok := s.c.reserved[peerID]
	s.mu.RUnlock()
	if !ok {
		return nil
	}
	return s.txn(ctx, nil, clientv3.OpDelete(s.cfg.Prefix+etcdReserved+peerID))
}

// Sync waits until the copy holds the newest write under the prefix: one
// small read (the key with the highest mod revision), then the watch.
func (s *EtcdStore) Sync(ctx context.Context) error {
	resp, err := s.cli.Get(ctx, s.cfg.Prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(1),
		clientv3.WithSort(clientv3.SortByModRevision, clientv3.SortDescend))
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	if len(resp.Kvs) == 0 {
		return nil
	}
	return s.caughtUp(ctx, resp.Kvs[0].ModRevision, false)
}

func (s *EtcdStore) Trackers(context.Context) ([]TrackerInfo, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]TrackerInfo, 0, len(s.c.trackers))
	for _, t := range s.c.trackers {
		out = append(out, t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PeerID < out[j].PeerID })
	return out, nil
}

// publish keeps trackers/<self> under a kept-alive lease until ctx ends,
// then withdraws it; a lost lease (etcd unreachable for a while) is
// replaced.
func (s *EtcdStore) publish(ctx context.Context) {
	defer s.wg.Done()
	b, _ := json.Marshal(s.cfg.Self)
	key := s.cfg.Prefix + etcdTrackers + s.cfg.Self.PeerID
	for ctx.Err() == nil {
		lease, err := s.grant(ctx, max(s.cfg.TTL, 5*time.Second))
		if err == nil {
			_, err = s.cli.Put(ctx, key, string(b), clientv3.WithLease(lease))
		}
		if err == nil {
			var ka <-chan *clientv3.LeaseKeepAliveResponse
			if ka, err = s.cli.KeepAlive(ctx, lease); err == nil {
				for range ka {
				}
			}
			if ctx.Err() != nil {
				s.revoke(lease)
				return
			}
		}
		if err != nil && ctx.Err() == nil {
			s.log.Warn("etcd: publishing this tracker failed", "err", err)
		}
		t := time.NewTimer(time.Second)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}
