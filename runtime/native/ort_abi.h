// The few entries of ONNX Runtime's C API that the attention kernel (attention.cc) calls, declared by their positions.
//
// The Python wheel ships no C headers. OrtApi is a table of function pointers that ONNX Runtime only ever appends
// to, so an entry's index is fixed from the version that added it on; each index below is that entry's position in
// the table (0-based), and OrtCustomOp's fields are in their order. The library asks for API version 17 (ONNX
// Runtime 1.17, the first with KernelContext_ParallelFor); runtime/cpu_attention.py uses the kernel on such a runtime
// only.
#pragma once
#include <stddef.h>
#include <stdint.h>

struct OrtStatus;
struct OrtValue;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtTensorTypeAndShapeInfo;
struct OrtApi;

constexpr uint32_t kOrtApiVersion = 17;

enum OrtElementType : int { kOrtFloat = 1, kOrtUint8 = 2, kOrtInt32 = 6, kOrtInt64 = 7, kOrtFloat16 = 10 };
enum OrtErrorCodeValue : int { kOrtFail = 1, kOrtInvalidArgument = 2 };
enum OrtCharacteristic : int { kOrtRequired = 0, kOrtOptional = 1 };

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// One function pointer per slot; `at<I>()` reads slot I as the signature the caller names.
struct OrtApi {
  void* slot[275];
};

namespace ort {
using CreateStatusFn = OrtStatus* (*)(int code, const char* message);
using CreateCustomOpDomainFn = OrtStatus* (*)(const char* domain, OrtCustomOpDomain** out);
using CustomOpDomainAddFn = OrtStatus* (*)(OrtCustomOpDomain* domain, const void* op);
using AddCustomOpDomainFn = OrtStatus* (*)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
using GetTensorMutableDataFn = OrtStatus* (*)(OrtValue* value, void** out);
using GetDimensionsCountFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
using GetDimensionsFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, int64_t* values, size_t count);
using GetTensorTypeAndShapeFn = OrtStatus* (*)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
using KernelInfoGetAttributeFloatFn = OrtStatus* (*)(const OrtKernelInfo* info, const char* name, float* out);
using KernelInfoGetAttributeInt64Fn = OrtStatus* (*)(const OrtKernelInfo* info, const char* name, int64_t* out);
using KernelContextGetCountFn = OrtStatus* (*)(const OrtKernelContext* context, size_t* out);
using KernelContextGetInputFn = OrtStatus* (*)(const OrtKernelContext* context, size_t index, const OrtValue** out);
using KernelContextGetOutputFn = OrtStatus* (*)(OrtKernelContext* context, size_t index, const int64_t* shape,
                                                size_t count, OrtValue** out);
using ReleaseStatusFn = void (*)(OrtStatus* status);
using ReleaseTypeAndShapeFn = void (*)(OrtTensorTypeAndShapeInfo* info);
using ParallelForFn = OrtStatus* (*)(const OrtKernelContext* context, void (*fn)(void*, size_t), size_t total,
                                     size_t batches, void* data);

enum Slot : int {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInputCount = 88,
  kKernelContextGetOutputCount = 89,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelContextParallelFor = 274,
};

template <typename Fn>
Fn at(const OrtApi* api, Slot slot) {
  return reinterpret_cast<Fn>(api->slot[slot]);
}
}  // namespace ort

// The custom op's table, in ONNX Runtime's field order; fields after KernelDestroy that are null are not called.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  int (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  void* CreateKernelV2;
  void* KernelComputeV2;
  void* InferOutputShapeFn;
  int (*GetStartVersion)(const OrtCustomOp* op);
  int (*GetEndVersion)(const OrtCustomOp* op);
  void* GetMayInplace;
  void* ReleaseMayInplace;
  void* GetAliasMap;
  void* ReleaseAliasMap;
};

