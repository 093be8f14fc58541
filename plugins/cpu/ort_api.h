// The part of ONNX Runtime's C API that plugins/cpu/ort_ops.cpp uses, declared from its
// documentation (onnxruntime_c_api.h), and the helpers its ops share.
//
// No installable package ships ONNX Runtime's C API header. `OrtApi` is a table of function
// pointers that only ever grows, so each function used is called through its slot. Slots and
// layouts were checked against onnxruntime 1.32.0 (tests/test_cpu_kernels.py runs the ops there).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dspark_ort {


// Opaque ONNX Runtime types: only pointers to them pass through here.
struct OrtApi;
struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtShape;   // OrtTensorTypeAndShapeInfo
struct OrtSessionOptions;
struct OrtCustomOpDomain;

struct OrtApiBase {
    const OrtApi* (*GetApi)(uint32_t version);
    const char* (*GetVersionString)();
};

constexpr uint32_t API_VERSION = 17;   // KernelContext_ParallelFor is 1.17's
constexpr int FLOAT = 1, UINT8 = 2, INT32 = 6, INT64 = 7, FLOAT16 = 10;   // ONNXTensorElementDataType
constexpr int ORT_FAIL = 1;

// The OrtApi slots used, and their signatures.
template <typename F> F slot(const OrtApi* api, int index) {
    return reinterpret_cast<F const*>(api)[index];
}
using CreateStatus = OrtStatus* (*)(int code, const char* message);
using CreateCustomOpDomain = OrtStatus* (*)(const char*, OrtCustomOpDomain**);
using CustomOpDomainAdd = OrtStatus* (*)(OrtCustomOpDomain*, const void* op);
using AddCustomOpDomain = OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*);
using GetAttributeFloat = OrtStatus* (*)(const OrtKernelInfo*, const char*, float*);
using GetAttributeInt64 = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);
using GetInput = OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**);
using GetOutput = OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
using GetData = OrtStatus* (*)(OrtValue*, void**);
using GetShape = OrtStatus* (*)(const OrtValue*, OrtShape**);
using GetElementType = OrtStatus* (*)(const OrtShape*, int*);
using GetDimensionsCount = OrtStatus* (*)(const OrtShape*, size_t*);
using GetDimensions = OrtStatus* (*)(const OrtShape*, int64_t*, size_t);
using ReleaseShape = void (*)(OrtShape*);
using ParallelFor = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
enum Slot {
    CREATE_STATUS = 0, CREATE_CUSTOM_OP_DOMAIN = 26, CUSTOM_OP_DOMAIN_ADD = 27, ADD_CUSTOM_OP_DOMAIN = 28,
    GET_TENSOR_MUTABLE_DATA = 51, GET_TENSOR_ELEMENT_TYPE = 60, GET_DIMENSIONS_COUNT = 61,
    GET_DIMENSIONS = 62, GET_TENSOR_TYPE_AND_SHAPE = 65, KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85,
    KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    KERNEL_CONTEXT_GET_INPUT = 90, KERNEL_CONTEXT_GET_OUTPUT = 91,
    RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99, KERNEL_CONTEXT_PARALLEL_FOR = 274,
};

// struct OrtCustomOp: `version`, then 25 function pointers (those left null are not called at
// version 17, or are optional).
struct OrtCustomOp {
    uint32_t version;
    void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
    const char* (*GetName)(const OrtCustomOp*);
    const char* (*GetExecutionProviderType)(const OrtCustomOp*);
    int (*GetInputType)(const OrtCustomOp*, size_t);
    size_t (*GetInputTypeCount)(const OrtCustomOp*);
    int (*GetOutputType)(const OrtCustomOp*, size_t);
    size_t (*GetOutputTypeCount)(const OrtCustomOp*);
    void (*KernelCompute)(void*, OrtKernelContext*);
    void (*KernelDestroy)(void*);
    int (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
    int (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
    int (*GetInputMemoryType)(const OrtCustomOp*, size_t);
    int (*GetVariadicInputMinArity)(const OrtCustomOp*);
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
    OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
    OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
    void* InferOutputShapeFn;
    int (*GetStartVersion)(const OrtCustomOp*);
    int (*GetEndVersion)(const OrtCustomOp*);
    void* GetMayInplace;
    void* ReleaseMayInplace;
    void* GetAliasMap;
    void* ReleaseAliasMap;
};
static_assert(sizeof(OrtCustomOp) == 208, "OrtCustomOp: 4 bytes, padding and 25 pointers");

inline const OrtApi* g_api = nullptr;   // set by RegisterCustomOps

struct Tensor {
    void* data;
    int type;
    std::vector<int64_t> dims;
    int64_t size() const {
        int64_t n = 1;
        for (int64_t d : dims) n *= d;
        return n;
    }
};

inline Tensor input(OrtKernelContext* context, size_t index) {
    const OrtValue* value = nullptr;
    slot<GetInput>(g_api, KERNEL_CONTEXT_GET_INPUT)(context, index, &value);
    Tensor t{};
    slot<GetData>(g_api, GET_TENSOR_MUTABLE_DATA)(const_cast<OrtValue*>(value), &t.data);
    OrtShape* shape = nullptr;
    slot<GetShape>(g_api, GET_TENSOR_TYPE_AND_SHAPE)(value, &shape);
    size_t rank = 0;
    slot<GetElementType>(g_api, GET_TENSOR_ELEMENT_TYPE)(shape, &t.type);
    slot<GetDimensionsCount>(g_api, GET_DIMENSIONS_COUNT)(shape, &rank);
    t.dims.resize(rank);
    slot<GetDimensions>(g_api, GET_DIMENSIONS)(shape, t.dims.data(), rank);
    slot<ReleaseShape>(g_api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO)(shape);
    return t;
}

inline OrtStatus* error(const char* op, const std::string& message) {
    return slot<CreateStatus>(g_api, CREATE_STATUS)(ORT_FAIL, ("dspark.cpu::" + std::string(op) + ": " + message).c_str());
}

inline void* output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& dims) {
    OrtValue* value = nullptr;
    slot<GetOutput>(g_api, KERNEL_CONTEXT_GET_OUTPUT)(context, index, dims.data(), dims.size(), &value);
    void* data = nullptr;
    slot<GetData>(g_api, GET_TENSOR_MUTABLE_DATA)(value, &data);
    return data;
}

inline OrtStatus* parallel_for(OrtKernelContext* context, void (*fn)(void*, size_t), size_t total, void* data) {
    return slot<ParallelFor>(g_api, KERNEL_CONTEXT_PARALLEL_FOR)(context, fn, total, 0, data);
}

// `state` as the kernel, unless reading its attribute failed (`read`: that status).
template <typename State>
OrtStatus* created(State* state, OrtStatus* read, void** kernel) {
    if (read) {
        delete state;
        return read;
    }
    *kernel = state;
    return nullptr;
}

template <typename State>
OrtCustomOp make_op(const char* (*name)(const OrtCustomOp*), size_t (*inputs)(const OrtCustomOp*),
                    int (*input_type)(const OrtCustomOp*, size_t), size_t (*outputs)(const OrtCustomOp*),
                    decltype(OrtCustomOp::CreateKernelV2) create, decltype(OrtCustomOp::KernelComputeV2) compute,
                    int (*output_type)(const OrtCustomOp*, size_t) = [](const OrtCustomOp*, size_t) { return FLOAT; }) {
    OrtCustomOp op{};
    op.version = API_VERSION;
    op.GetName = name;
    op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };   // CPU
    op.GetInputTypeCount = inputs;
    op.GetInputType = input_type;
    op.GetOutputTypeCount = outputs;
    op.GetOutputType = output_type;
    op.KernelDestroy = [](void* state) { delete static_cast<State*>(state); };
    op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };    // required
    op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return 0; };
    op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return 0; };        // default (CPU)
    op.CreateKernelV2 = create;
    op.KernelComputeV2 = compute;
    return op;
}

}  // namespace dspark_ort
