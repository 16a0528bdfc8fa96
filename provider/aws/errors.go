package aws

import (
	"errors"

	"github.com/aws/smithy-go"
)

// What an EC2 error code means for a runner's start. The codes are those
// of the EC2 API reference's error list.
type errKind int

const (
	errOther    errKind = iota // transient or unknown: the pool backs off
	errCapacity                // this type, zone or market has none: try the next
	errFatal                   // no retry can fix it: the pool stops, saying why
	errThrottle                // RequestLimitExceeded after the SDK's own retries
	// errRefused: refused for this instance type or subnet (a type the
	// region lacks or the AMI's architecture does not run, a subnet that
	// is not there, a policy that allows other types or subnets): the
	// next is tried, and the pool stops only if every one refuses, as on
	// Compute Engine and Azure.
	errRefused
)

var errKinds = map[string]errKind{
	"InsufficientInstanceCapacity":                errCapacity,
	"InsufficientHostCapacity":                    errCapacity,
	"InsufficientReservedInstanceCapacity":        errCapacity,
	"InsufficientCapacity":                        errCapacity,
	"SpotMaxPriceTooLow":                          errCapacity,
	"MaxSpotInstanceCountExceeded":                errCapacity,
	"InstanceLimitExceeded":                       errCapacity,
	"VcpuLimitExceeded":                           errCapacity,
	"Unsupported":                                 errCapacity, // the type is not offered in the subnet's zone
	"UnsupportedOperation":                        errCapacity,
	"RequestLimitExceeded":                        errThrottle,
	"AuthFailure":                                 errFatal,
	"UnauthorizedOperation":                       errRefused, // an IAM condition on ec2:InstanceType or the subnet
	"Blocked":                                     errFatal,
	"OptInRequired":                               errFatal,
	"PendingVerification":                         errFatal,
	"InvalidAMIID.NotFound":                       errFatal,
	"InvalidAMIID.Malformed":                      errFatal,
	"InvalidAMIID.Unavailable":                    errFatal,
	"InvalidSubnetID.NotFound":                    errRefused,
	"InvalidSubnetID.Malformed":                   errRefused,
	"InvalidGroup.NotFound":                       errFatal,
	"InvalidGroupId.Malformed":                    errFatal,
	"InvalidKeyPair.NotFound":                     errFatal,
	"InvalidParameterValue":                       errRefused, // "Invalid value 'z9.huge' for InstanceType."
	"InvalidParameterCombination":                 errRefused, // a type the AMI's architecture does not run
	"InvalidParameter":                            errFatal,
	"MissingParameter":                            errFatal,
	"InvalidUserData.Malformed":                   errFatal,
	"InvalidLaunchTemplateId.NotFound":            errFatal,
	"InvalidLaunchTemplateId.Malformed":           errFatal,
	"InvalidLaunchTemplateName.NotFoundException": errFatal,
	"InvalidLaunchTemplateId.VersionNotFound":     errFatal,
	"InvalidIamInstanceProfile.NotFound":          errFatal,
	"InvalidBlockDeviceMapping":                   errRefused, // a type without the device the mapping names
	"SignatureDoesNotMatch":                       errFatal,
	"InvalidClientTokenId":                        errFatal,
}

// kindOf classifies an error of a call.
func kindOf(err error) (errKind, string) {
	c := code(err)
	return errKinds[c], c
}

// code is an EC2 error's code, "" for no error or one without.
func code(err error) string {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return ae.ErrorCode()
	}
	return ""
}
