package gcesim

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"cloud.google.com/go/auth/credentials"
	"cloud.google.com/go/auth/httptransport"
	billing "cloud.google.com/go/billing/apiv1"
	"cloud.google.com/go/billing/apiv1/billingpb"
	compute "cloud.google.com/go/compute/apiv1"
	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/iterator"
	"google.golang.org/api/option"
	"google.golang.org/protobuf/proto"
)

// newClient starts a stand-in with one image and Google's client of it.
func newClient(t *testing.T) (*Server, *compute.InstancesClient) {
	t.Helper()
	s, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	s.AddImage("projects/runfleet-e2e/global/images/i", "")
	creds, err := credentials.NewCredentialsFromJSON(credentials.ServiceAccount, s.Credentials(), &credentials.DetectOptions{Scopes: []string{"https://www.googleapis.com/auth/compute"}})
	if err != nil {
		t.Fatal(err)
	}
	hc, err := httptransport.NewClient(&httptransport.Options{Credentials: creds})
	if err != nil {
		t.Fatal(err)
	}
	c, err := compute.NewInstancesRESTClient(context.Background(), option.WithHTTPClient(hc), option.WithEndpoint(s.URL))
	if err != nil {
		t.Fatal(err)
	}
	return s, c
}

// The stand-in answers Google's own client as Compute Engine does:
// OAuth with the key, an insert's operation waited for, aggregated pages
// of a filtered list, and its error bodies.
func TestGoogleClientAgainstTheStandIn(t *testing.T) {
	s, c := newClient(t)
	ctx := context.Background()
	for i := range 5 {
		zone := Zones[i%2]
		op, err := c.Insert(ctx, &computepb.InsertInstanceRequest{Project: Project, Zone: zone, InstanceResource: &computepb.Instance{
			Name: proto.String(fmt.Sprintf("vm-%d", i)), MachineType: proto.String("zones/" + zone + "/machineTypes/e2-small"),
			Labels: map[string]string{"pool": []string{"a", "b"}[i%2]},
			Disks:  []*computepb.AttachedDisk{{Boot: proto.Bool(true), AutoDelete: proto.Bool(true), InitializeParams: &computepb.AttachedDiskInitializeParams{SourceImage: proto.String("projects/runfleet-e2e/global/images/i")}}},
		}})
		if err != nil {
			t.Fatal(err)
		}
		if err := op.Wait(ctx); err != nil || op.Proto().GetError() != nil {
			t.Fatalf("insert vm-%d: %v %v", i, err, op.Proto().GetError())
		}
	}
	var names []string
	it := c.AggregatedList(ctx, &computepb.AggregatedListInstancesRequest{Project: Project, Filter: proto.String(`labels.pool = "a"`), MaxResults: proto.Uint32(1)})
	for {
		pair, err := it.Next()
		if errors.Is(err, iterator.Done) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, in := range pair.Value.GetInstances() {
			names = append(names, in.GetName())
		}
	}
	if fmt.Sprint(names) != "[vm-0 vm-2 vm-4]" || s.Calls()["instances.aggregatedList"] != 3 {
		t.Errorf("pool a = %v in %d pages, want vm-0 vm-2 vm-4 in pages of one", names, s.Calls()["instances.aggregatedList"])
	}
	_, err := c.Get(ctx, &computepb.GetInstanceRequest{Project: Project, Zone: Zones[0], Instance: "nope"})
	var ge *googleapi.Error
	if !errors.As(err, &ge) || ge.Code != 404 || ge.Errors[0].Reason != "notFound" {
		t.Errorf("get of a missing instance: %v", err)
	}
	_, err = c.Insert(ctx, &computepb.InsertInstanceRequest{Project: Project, Zone: Zones[0], InstanceResource: &computepb.Instance{Name: proto.String("Bad Name")}})
	if !errors.As(err, &ge) || ge.Code != 400 || ge.Errors[0].Reason != "invalid" {
		t.Errorf("insert of a bad name: %v", err)
	}
	for _, f := range []string{`labels.pool = "a"`, `(labels.pool = a) (name != vm-0)`, `labels.pool = "a" AND name = "vm-2"`} {
		if _, err := parseFilter(f); err != nil {
			t.Errorf("filter %q: %v", f, err)
		}
	}
	if _, err := parseFilter(`labels.pool ~ a`); err == nil {
		t.Error("a filter the stand-in cannot read is taken")
	}
}

// A bulk insert is one request for many instances: what fits is made
// when at least minCount fits, nothing otherwise, and its operation says
// how many; a machine type given as a URL is Compute Engine's internal
// error.
func TestBulkInsert(t *testing.T) {
	s, c := newClient(t)
	ctx := context.Background()
	s.LimitCapacity("STANDARD", "e2-small", Zones[0], 2)
	live := func() (n int) {
		for _, in := range s.Instances() {
			if in.Deleted.IsZero() {
				n++
			}
		}
		return n
	}
	bulk := func(machineType string, minCount int64, names ...string) (*computepb.Operation, error) {
		per := map[string]*computepb.BulkInsertInstanceResourcePerInstanceProperties{}
		for _, n := range names {
			per[n] = &computepb.BulkInsertInstanceResourcePerInstanceProperties{}
		}
		op, err := c.BulkInsert(ctx, &computepb.BulkInsertInstanceRequest{Project: Project, Zone: Zones[0], BulkInsertInstanceResourceResource: &computepb.BulkInsertInstanceResource{
			Count: proto.Int64(int64(len(names))), MinCount: proto.Int64(minCount), PerInstanceProperties: per,
			InstanceProperties: &computepb.InstanceProperties{MachineType: proto.String(machineType), Labels: map[string]string{"pool": "a"},
				Disks: []*computepb.AttachedDisk{{Boot: proto.Bool(true), AutoDelete: proto.Bool(true), InitializeParams: &computepb.AttachedDiskInitializeParams{SourceImage: proto.String("projects/runfleet-e2e/global/images/i"), DiskType: proto.String("pd-balanced")}}}},
		}})
		if err != nil {
			return nil, err
		}
		_ = op.Wait(ctx)
		return op.Proto(), nil
	}
	op, err := bulk("e2-small", 3, "a-1", "a-2", "a-3")
	if err != nil {
		t.Fatal(err)
	}
	st := op.GetInstancesBulkInsertOperationMetadata().GetPerLocationStatus()["zones/"+Zones[0]]
	if op.GetError() == nil || st.GetCreatedVmCount() != 0 || st.GetDeletedVmCount() != 2 || live() != 0 {
		t.Errorf("3 asked for at least 3 with room for 2: error %v, status %v, %d instances; want the two rolled back", op.GetError(), st, live())
	}
	op, err = bulk("e2-small", 1, "b-1", "b-2", "b-3")
	if err != nil {
		t.Fatal(err)
	}
	st = op.GetInstancesBulkInsertOperationMetadata().GetPerLocationStatus()["zones/"+Zones[0]]
	if op.GetError() != nil || st.GetCreatedVmCount() != 2 || st.GetTargetVmCount() != 3 || live() != 2 {
		t.Errorf("3 asked for at least 1 with room for 2: error %v, status %v, %d instances; want 2 made", op.GetError(), st, live())
	}
	if s.Calls()["instances.bulkInsert"] != 2 || s.Calls()["instances.insert"] != 0 {
		t.Errorf("calls %v", s.Calls())
	}
	var ge *googleapi.Error
	if _, err := bulk("zones/"+Zones[0]+"/machineTypes/e2-small", 1, "c-1"); !errors.As(err, &ge) || ge.Code != 500 {
		t.Errorf("a machine type's URL in instanceProperties: %v, want 500", err)
	}
	if _, err := bulk("e2-small", 1, "b-1"); !errors.As(err, &ge) || ge.Code != 409 {
		t.Errorf("a name taken: %v, want 409", err)
	}
}

// The catalog answers Google's own billing client with a token of the
// billing scope, and refuses one for Compute Engine alone, as Google
// does (403 ACCESS_TOKEN_SCOPE_INSUFFICIENT); it pages as asked.
func TestCatalogScopesAndPages(t *testing.T) {
	s, _ := newClient(t)
	list := func(scope string, pageSize int32) (int, error) {
		creds, err := credentials.NewCredentialsFromJSON(credentials.ServiceAccount, s.Credentials(), &credentials.DetectOptions{Scopes: []string{scope}})
		if err != nil {
			t.Fatal(err)
		}
		hc, err := httptransport.NewClient(&httptransport.Options{Credentials: creds})
		if err != nil {
			t.Fatal(err)
		}
		c, err := billing.NewCloudCatalogRESTClient(context.Background(), option.WithHTTPClient(hc), option.WithEndpoint(s.URL))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		it := c.ListSkus(context.Background(), &billingpb.ListSkusRequest{Parent: "services/" + ComputeService, PageSize: pageSize})
		n := 0
		for {
			_, err := it.Next()
			if errors.Is(err, iterator.Done) {
				return n, nil
			}
			if err != nil {
				return n, err
			}
			n++
		}
	}
	var ge *googleapi.Error
	if _, err := list("https://www.googleapis.com/auth/compute", 0); !errors.As(err, &ge) || ge.Code != 403 {
		t.Errorf("a Compute Engine token: %v, want 403", err)
	}
	all, err := list("https://www.googleapis.com/auth/cloud-billing.readonly", 0)
	if err != nil || all != len(skus()) {
		t.Fatalf("%d SKUs, %v; want %d", all, err, len(skus()))
	}
	if paged, err := list("https://www.googleapis.com/auth/cloud-platform", 7); err != nil || paged != all {
		t.Errorf("in pages of 7: %d SKUs, %v; want %d", paged, err, all)
	}
	if n := s.Calls()["services.skus.list"]; n < 2+all/7 {
		t.Errorf("%d list calls: pageSize not kept", n)
	}
}
