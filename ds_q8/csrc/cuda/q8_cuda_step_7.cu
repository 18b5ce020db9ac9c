// Part 7 of the step's rules (q8_cuda_step.cuh: the rule at place i of Q8_RULES is in part i % kStepParts).
#include "q8_cuda_step.cuh"

namespace ds_q8 {

template <>
bool step_in_part<7>(const StepBatch& b, const std::map<std::string, double>& hyper) {
    return step_rules_of_part<7>(b, hyper);
}

}  // namespace ds_q8
