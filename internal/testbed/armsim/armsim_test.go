package armsim_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/arm"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/cloud"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/runtime"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/to"
	"github.com/Azure/azure-sdk-for-go/sdk/azidentity"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v7"

	"github.com/runfleet/runfleet/internal/testbed/armsim"
)

const image = "Canonical:ubuntu-24_04-lts:server:latest"

// client is armcompute's client on the stand-in over HTTPS, with the
// service principal's secret.
func client(t *testing.T, sim *armsim.Server, secret string) *armcompute.VirtualMachinesClient {
	t.Helper()
	pem, err := os.ReadFile(sim.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	cfg := cloud.Configuration{ActiveDirectoryAuthorityHost: sim.URL + "/", Services: map[cloud.ServiceName]cloud.ServiceConfiguration{
		cloud.ResourceManager: {Endpoint: sim.URL, Audience: "https://management.core.windows.net/"}}}
	cred, err := azidentity.NewClientSecretCredential(armsim.Tenant, armsim.ClientID, secret, &azidentity.ClientSecretCredentialOptions{
		ClientOptions: azcore.ClientOptions{Cloud: cfg, Transport: hc}, DisableInstanceDiscovery: true})
	if err != nil {
		t.Fatal(err)
	}
	c, err := armcompute.NewVirtualMachinesClient(armsim.Subscription, cred, &arm.ClientOptions{ClientOptions: policy.ClientOptions{Cloud: cfg, Transport: hc}})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func vm(loc, size string, spot bool) armcompute.VirtualMachine {
	v := armcompute.VirtualMachine{Location: to.Ptr(loc), Tags: map[string]*string{"runfleet-runner": to.Ptr("r-1")}, Properties: &armcompute.VirtualMachineProperties{
		HardwareProfile: &armcompute.HardwareProfile{VMSize: to.Ptr(armcompute.VirtualMachineSizeTypes(size))},
		StorageProfile: &armcompute.StorageProfile{ImageReference: &armcompute.ImageReference{Publisher: to.Ptr("Canonical"), Offer: to.Ptr("ubuntu-24_04-lts"), SKU: to.Ptr("server"), Version: to.Ptr("latest")},
			OSDisk: &armcompute.OSDisk{CreateOption: to.Ptr(armcompute.DiskCreateOptionTypesFromImage), DeleteOption: to.Ptr(armcompute.DiskDeleteOptionTypesDelete)}},
		OSProfile: &armcompute.OSProfile{ComputerName: to.Ptr("vm"), AdminUsername: to.Ptr("runfleet"), LinuxConfiguration: &armcompute.LinuxConfiguration{
			DisablePasswordAuthentication: to.Ptr(true), SSH: &armcompute.SSHConfiguration{PublicKeys: []*armcompute.SSHPublicKey{{Path: to.Ptr("/home/runfleet/.ssh/authorized_keys"), KeyData: to.Ptr("ssh-ed25519 AAAA")}}}}},
		NetworkProfile: &armcompute.NetworkProfile{NetworkAPIVersion: to.Ptr(armcompute.NetworkAPIVersionTwoThousandTwenty1101),
			NetworkInterfaceConfigurations: []*armcompute.VirtualMachineNetworkInterfaceConfiguration{{Name: to.Ptr("nic"), Properties: &armcompute.VirtualMachineNetworkInterfaceConfigurationProperties{
				DeleteOption: to.Ptr(armcompute.DeleteOptionsDelete), IPConfigurations: []*armcompute.VirtualMachineNetworkInterfaceIPConfiguration{{Name: to.Ptr("ip"),
					Properties: &armcompute.VirtualMachineNetworkInterfaceIPConfigurationProperties{Subnet: &armcompute.SubResource{ID: to.Ptr(armsim.SubnetID(loc))}}}}}}}},
	}}
	if spot {
		v.Properties.Priority = to.Ptr(armcompute.VirtualMachinePriorityTypesSpot)
		v.Properties.EvictionPolicy = to.Ptr(armcompute.VirtualMachineEvictionPolicyTypesDelete)
		v.Properties.BillingProfile = &armcompute.BillingProfile{MaxPrice: to.Ptr(-1.0)}
	}
	return v
}

func code(err error) string {
	var re *azcore.ResponseError
	if errors.As(err, &re) {
		return re.ErrorCode
	}
	return ""
}

// Azure's own client, over HTTPS with a service principal's token:
// a VM is made (its operation polled), listed with its power state, and
// deleted with its NIC and disk; the documented errors come where Azure
// gives them.
func TestStandInAnswersAsAzure(t *testing.T) {
	sim, err := armsim.New(armsim.Options{PollAfter: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sim.Close)
	sim.AddImage(image, "")
	ctx := context.Background()
	c := client(t, sim, sim.Secret())

	poller, err := c.BeginCreateOrUpdate(ctx, armsim.Group, "vm-1", vm("eastus", "Standard_D2s_v5", true), nil)
	if err != nil {
		t.Fatal(err)
	}
	made, err := poller.PollUntilDone(ctx, &runtime.PollUntilDoneOptions{Frequency: time.Second})
	if err != nil || *made.Properties.ProvisioningState != "Succeeded" {
		t.Fatalf("created: %v %v", made.Properties, err)
	}
	time.Sleep(300 * time.Millisecond)
	pager := c.NewListAllPager(&armcompute.VirtualMachinesClientListAllOptions{StatusOnly: to.Ptr("true")})
	page, err := pager.NextPage(ctx)
	if err != nil || len(page.Value) != 1 || pager.More() {
		t.Fatalf("list: %d VMs, %v", len(page.Value), err)
	}
	st := page.Value[0].Properties.InstanceView.Statuses
	if len(st) != 2 || *st[1].Code != "PowerState/running" || page.Value[0].Properties.OSProfile.CustomData != nil {
		t.Errorf("listed: %v", page.Value[0].Properties)
	}
	if _, err := c.BeginDelete(ctx, armsim.Group, "vm-1", nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if _, err := c.Get(ctx, armsim.Group, "vm-1", nil); code(err) != "ResourceNotFound" {
		t.Errorf("get after delete: %v", err)
	}
	if left := sim.Leftovers(); len(left) != 0 {
		t.Errorf("left: %v", left)
	}

	sim.NoSKU("Standard_NC6s_v3", "eastus")
	if _, err := c.BeginCreateOrUpdate(ctx, armsim.Group, "vm-2", vm("eastus", "Standard_NC6s_v3", false), nil); code(err) != "SkuNotAvailable" {
		t.Errorf("no SKU: %v", err)
	}
	sim.NoQuota("westus2")
	if _, err := c.BeginCreateOrUpdate(ctx, armsim.Group, "vm-3", vm("westus2", "Standard_D2s_v5", false), nil); code(err) != "OperationNotAllowed" || !strings.Contains(err.Error(), "quota") {
		t.Errorf("no quota: %v", err)
	}
	sim.NoCapacity("Spot", "", "northeurope")
	poller, err = c.BeginCreateOrUpdate(ctx, armsim.Group, "vm-4", vm("northeurope", "Standard_D2s_v5", true), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := poller.PollUntilDone(ctx, &runtime.PollUntilDoneOptions{Frequency: time.Second}); code(err) != "AllocationFailed" {
		t.Errorf("no capacity: %v", err)
	}
	if _, err := c.BeginCreateOrUpdate(ctx, "nope", "vm-5", vm("eastus", "Standard_D2s_v5", false), nil); code(err) != "ResourceGroupNotFound" {
		t.Errorf("no group: %v", err)
	}
	bad := client(t, sim, "wrong")
	if _, err := bad.Get(ctx, armsim.Group, "vm-4", nil); err == nil || !strings.Contains(err.Error(), "AADSTS7000215") {
		t.Errorf("a wrong secret: %v", err)
	}
	t.Logf("calls: %v", sim.Calls())
}
